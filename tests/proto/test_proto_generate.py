"""The generated gRPC package: current, deterministic, importable, and the messages other teams rely on."""

import json
import subprocess
import sys
from pathlib import Path


def run_generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "splitserve.proto.generate", *args], capture_output=True, text=True, timeout=60
    )


def test_committed_code_is_current():
    result = run_generate("--check")
    assert result.returncode == 0, result.stderr
    assert "is up to date" in result.stdout


def test_check_reports_stale_missing_and_extra_files(tmp_path: Path):
    assert run_generate("--output-dir", str(tmp_path)).returncode == 0
    assert run_generate("--check", "--output-dir", str(tmp_path)).returncode == 0
    (tmp_path / "handoff_pb2.pyi").write_text("# edited by hand\n")
    (tmp_path / "common_pb2.py").unlink()
    (tmp_path / "old_pb2.py").write_text("")
    result = run_generate("--check", "--output-dir", str(tmp_path))
    assert result.returncode == 1
    assert f"{tmp_path} is stale: run `python -m splitserve.proto.generate`" in result.stderr
    assert "missing: common_pb2.py" in result.stderr
    assert "not generated from any .proto (delete it): old_pb2.py" in result.stderr
    assert "differs: handoff_pb2.pyi: -# edited by hand" in result.stderr


def test_generation_is_deterministic_and_imports_are_rewritten():
    # protoc runs in a child process: in-process protoc crashes once NIXL's UCX
    # libraries are loaded in the same pytest process (seen with the transfer tests).
    code = (
        "import json; from splitserve.proto import generate\n"
        "a, b = generate.render(), generate.render()\n"
        "print(json.dumps({'same': a == b, 'files': a}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["same"]
    for name, text in out["files"].items():
        assert "from splitserve.v1 import" not in text, name
    assert "from splitserve.proto.v1 import common_pb2" in out["files"]["handoff_pb2.py"]


def test_handoff_descriptor_has_exactly_the_agreed_fields():
    from splitserve.proto.v1 import handoff_pb2

    fields = [f.name for f in handoff_pb2.HandoffDescriptor.DESCRIPTOR.fields]
    assert fields == [
        "request_id", "model_fingerprint", "layout", "rank_blocks", "num_tokens", "transport_kind",
        "rank_endpoints", "first_token_id", "first_token_logprob", "first_token_top_logprobs",
        "lease_deadline_unix_ms", "unit_checksums", "block_checksums", "progress_slot", "state",
    ]  # fmt: skip
    state = [f.name for f in handoff_pb2.StateHandoff.DESCRIPTOR.fields]
    assert state == ["layout", "slot", "checksum", "endpoints"]
    assert handoff_pb2.HandoffDescriptor.DESCRIPTOR.fields_by_name["first_token_logprob"].has_presence
    layout = [f.name for f in handoff_pb2.KVLayout.DESCRIPTOR.fields]
    assert layout == ["dtype", "block_size", "tp", "pp", "num_layers", "num_kv_heads", "head_dim", "layer_ranges"]
    message = handoff_pb2.HandoffDescriptor(
        request_id="r1",
        rank_blocks=[handoff_pb2.RankBlocks(rank=1, block_ids=[4, 5])],
        unit_checksums=[handoff_pb2.UnitChecksum(layer=0, kv_head=1, value=2**64 - 1)],
    )
    decoded = handoff_pb2.HandoffDescriptor.FromString(message.SerializeToString())
    assert decoded == message and not decoded.HasField("first_token_logprob")


def test_services_and_the_control_plane_stay_torch_free():
    code = (
        "import sys\n"
        "from splitserve.proto.v1 import control_plane_pb2_grpc, decode_worker_pb2_grpc, prefill_worker_pb2_grpc\n"
        "from splitserve.proto.v1 import decode_worker_pb2, prefill_worker_pb2\n"
        "import splitserve.control_plane.cli, splitserve.control_plane.worker_registration\n"
        "assert list(prefill_worker_pb2.DESCRIPTOR.services_by_name) == ['PrefillWorker']\n"
        "assert list(decode_worker_pb2.DESCRIPTOR.services_by_name) == ['DecodeWorker']\n"
        "assert 'torch' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
