"""Real prefill and decode worker processes, driven over gRPC the way the router
drives them: Prefill → HandoffDescriptor → Decode (NIXL pull, checksums) → tokens
identical to the aggregated engine, and the prefill side's pins released."""

import grpc
import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.wire import sampling_to_proto
from splitserve.proto.v1 import prefill_worker_pb2, prefill_worker_pb2_grpc
from tests.fixtures.models import build_hf_checkpoint
from tests.fixtures.workers import disagg_generate, running_worker

pytest.importorskip("nixl_cu13")

ENGINE_FLAGS = ["--block-size", "8", "--num-blocks", "256", "--max-tokens", "64"]
PARAMS = SamplingParams(num_tokens_to_generate=12, temperature=0.0, return_log_probs=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("disagg")
    build_hf_checkpoint(path, "llama", num_hidden_layers=2)
    return str(path)


def _prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 29, 40)]


LAYOUTS = [
    ("tp1", "tp1", ["--tp", "1"], ["--tp", "1"]),
    ("tp2", "tp1", ["--tp", "2"], ["--tp", "1"]),
    pytest.param("tp1", "tp2", ["--tp", "1"], ["--tp", "2"], marks=pytest.mark.slow),
    pytest.param("pp2", "tp2", ["--pp", "2"], ["--tp", "2"], marks=pytest.mark.slow),
    pytest.param("tp2", "pp2", ["--tp", "2"], ["--pp", "2"], marks=pytest.mark.slow),
]


@pytest.mark.parametrize("src, dst, prefill_flags, decode_flags", LAYOUTS)
def test_disaggregated_tokens_match_aggregated(model_dir, src, dst, prefill_flags, decode_flags):
    expected = LLM(model_dir, block_size_tokens=8, num_blocks=256).generate(_prompts(), PARAMS)
    prefill_tp = int(prefill_flags[1]) if prefill_flags[0] == "--tp" else 1
    with (
        running_worker("prefill-worker", model_dir, *prefill_flags, *ENGINE_FLAGS) as pw,
        running_worker("decode-worker", model_dir, *decode_flags, *ENGINE_FLAGS) as dw,
    ):
        results, blocks = disagg_generate(pw.address, dw.address, _prompts(), PARAMS)
    for (tokens, logprobs, resp), ref in zip(results, expected, strict=True):
        assert tokens == ref.generated_tokens
        assert logprobs == pytest.approx(ref.generated_log_probs, abs=1e-4)
        assert resp.handoff.layout.tp == prefill_tp
        assert len(resp.handoff.block_checksums) == len(resp.handoff.rank_blocks[0].block_ids)
    assert blocks.block_size == 8 and len(blocks.block_hashes) >= 3 + 5  # full prompt blocks are cached


def test_bad_requests_get_status_codes_not_tracebacks(model_dir):
    with running_worker("prefill-worker", model_dir, *ENGINE_FLAGS) as pw:
        with grpc.insecure_channel(pw.address) as ch:
            stub = prefill_worker_pb2_grpc.PrefillWorkerStub(ch)
            sp = sampling_to_proto(PARAMS)
            with pytest.raises(grpc.RpcError) as err:
                stub.Prefill(prefill_worker_pb2.PrefillRequest(request_id="e", token_ids=[], sampling_params=sp), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt is empty" in err.value.details()
            bad = sampling_to_proto(PARAMS)
            bad.temperature = -2
            with pytest.raises(grpc.RpcError) as err:
                stub.Prefill(prefill_worker_pb2.PrefillRequest(request_id="t", token_ids=[5], sampling_params=bad), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in err.value.details()
            assert not stub.Release(prefill_worker_pb2.ReleaseRequest(request_id="never"), timeout=10).was_pinned
