"""TP and PP engines (one process per rank, gloo) produce the same tokens as one rank."""

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.launch import generate_on_ranks
from splitserve.engine.parallel import kv_heads_of_rank, stage_layer_range
from tests.fixtures.models import build_hf_checkpoint

OPTIONS = dict(block_size_tokens=8, num_blocks=128, max_tokens=24)
PARAMS = SamplingParams(num_tokens_to_generate=32, temperature=0.0, ignore_eos=True, return_log_probs=True)


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 40, 17)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("par")
    build_hf_checkpoint(path, "qwen2", num_hidden_layers=3)  # odd layer count: uneven PP split
    return str(path), LLM(str(path), **OPTIONS).generate(_prompts(), PARAMS)


def _check(reference, tp, pp):
    path, expected = reference
    results = generate_on_ranks(path, _prompts(), PARAMS, tp, pp, **OPTIONS)
    for ours, ref in zip(results, expected, strict=True):
        assert ours.generated_tokens == ref.generated_tokens
        assert max(abs(a - b) for a, b in zip(ours.generated_log_probs, ref.generated_log_probs, strict=True)) < 1e-4


def test_tensor_parallel_2(reference):
    _check(reference, tp=2, pp=1)


def test_pipeline_parallel_2(reference):
    _check(reference, tp=1, pp=2)


@pytest.mark.slow
def test_tp4_replicated_kv_heads_and_tp2_pp2(reference):
    _check(reference, tp=4, pp=1)  # 2 kv heads over 4 ranks: each head held twice
    _check(reference, tp=2, pp=2)


def test_layouts():
    assert [stage_layer_range(5, 2, r) for r in range(2)] == [(0, 3), (3, 5)]
    assert [kv_heads_of_rank(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [kv_heads_of_rank(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    with pytest.raises(ValueError, match="multiple of 2 kv heads"):
        kv_heads_of_rank(2, 3, 0)
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        stage_layer_range(2, 4, 0)


def test_parallel_config_without_a_process_group_is_refused(reference):
    with pytest.raises(RuntimeError, match="needs torch.distributed"):
        LLM(reference[0], tensor_parallel_size=2, **OPTIONS)


def test_auto_device_follows_splitserve_auto_device(monkeypatch):
    """"auto" is the CPU when `SPLITSERVE_AUTO_DEVICE=cpu` (set by the rank launcher when the ranks
    talk over gloo, and by the test suite), else CUDA when present."""
    from splitserve.engine.devices import resolve_device

    monkeypatch.setenv("SPLITSERVE_AUTO_DEVICE", "cpu")
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setenv("SPLITSERVE_AUTO_DEVICE", "cuda")
    if torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cuda")
    else:  # said plainly, not torch's AssertionError from deep inside the model build
        with pytest.raises(ValueError, match="CUDA is not available here.*use --device cpu"):
            resolve_device("auto")
    assert resolve_device("cpu") == torch.device("cpu")  # an explicit device is kept
    monkeypatch.setenv("SPLITSERVE_AUTO_DEVICE", "gpu")
    with pytest.raises(ValueError, match="SPLITSERVE_AUTO_DEVICE must be cpu or cuda, got 'gpu'"):
        resolve_device("auto")
    monkeypatch.delenv("SPLITSERVE_AUTO_DEVICE")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_worker_group_backend_follows_the_engines_device(monkeypatch):
    """A worker group's process group is NCCL only when its engines run on CUDA: CPU engines on a
    GPU host talk over gloo (engine/worker_runtime.py)."""
    from splitserve.engine.worker_runtime import WorkerSpec, _group_on_cuda

    def spec(device):
        return WorkerSpec(model=None, role="prefill", engine_options={"device": device})

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU host
    assert not _group_on_cuda(spec("cpu"))
    assert _group_on_cuda(spec("cuda"))
    monkeypatch.setenv("SPLITSERVE_AUTO_DEVICE", "cpu")
    assert not _group_on_cuda(spec("auto"))
    assert not _group_on_cuda(WorkerSpec(model=None, role="decode"))  # no device option: "auto"


def test_a_cuda_group_with_more_ranks_than_gpus_is_refused_at_start(monkeypatch):
    from splitserve.engine.worker_runtime import WorkerGroup, WorkerSpec

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # a host with one GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    spec = WorkerSpec(model=None, role="prefill", tensor_parallel_size=2, engine_options={"device": "cuda"})
    with pytest.raises(ValueError, match=r"2 ranks \(--tp 2 x --pp 1\) on CUDA need a GPU each and this host has 1"):
        WorkerGroup(spec, hooks_factory=None)


def test_the_rank_launcher_refuses_a_cuda_group_with_more_ranks_than_gpus(monkeypatch):
    """`generate_on_ranks` follows the worker groups' rule (devices.group_on_cuda): CUDA engines
    need a GPU per rank, refused before any rank is spawned; CPU engines on a GPU host use gloo."""
    from splitserve.engine.devices import group_on_cuda

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # a host with one GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=r"4 ranks \(--tp 2 x --pp 2\) on CUDA need a GPU each and this host has 1"):
        generate_on_ranks(None, [[1, 2]], PARAMS, 2, 2, device="cuda")
    assert group_on_cuda("cuda", 1)  # one rank needs no group
    assert not group_on_cuda("cpu", 4)
    monkeypatch.setenv("SPLITSERVE_AUTO_DEVICE", "cpu")
    assert not group_on_cuda("auto", 4)
