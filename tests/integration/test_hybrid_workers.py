"""Hybrid (NemotronH: Mamba2 + attention) disaggregation through the real gRPC workers:
`splitserve prefill-worker` → HandoffDescriptor with the recurrent state (conv + SSM) →
`splitserve decode-worker` (NIXL pull, or a torch_dist push over gloo: KV, then state) →
greedy tokens identical to the aggregated engine, log-probs within 1e-5.

tp1 → tp1 runs in the default stage for both transports; resharding (tp2 → tp1, tp1 → tp2,
pp2) is marked slow. A descriptor without the state makes the hybrid decode worker recompute
the prompt (and say so), never generate from a missing state."""

import importlib.util

import grpc
import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.wire import sampling_to_proto
from splitserve.proto.v1 import (
    decode_worker_pb2,
    decode_worker_pb2_grpc,
    prefill_worker_pb2,
    prefill_worker_pb2_grpc,
)
from tests.fixtures.models import build_hybrid_checkpoint
from tests.fixtures.workers import disagg_generate, running_worker

HAS_NIXL = importlib.util.find_spec("nixl_cu13") is not None
ENGINE_FLAGS = ["--block-size", "8", "--num-blocks", "128", "--max-tokens", "64"]
PARAMS = SamplingParams(num_tokens_to_generate=12, temperature=0.0, ignore_eos=True, return_log_probs=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid_workers")
    build_hybrid_checkpoint(path)
    return str(path)


def _prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 29, 40)]


@pytest.fixture(scope="module")
def expected(model_dir):
    return LLM(model_dir, block_size_tokens=8, num_blocks=128).generate(_prompts(), PARAMS)


SHAPES = {"tp1": ["--tp", "1"], "tp2": ["--tp", "2"], "pp2": ["--pp", "2"]}
QUICK = {("nixl", "tp1", "tp1"), ("torch_dist", "tp1", "tp1")}
PAIRS = [("tp1", "tp1"), ("tp2", "tp1"), ("tp1", "tp2"), ("pp2", "tp1"), ("tp1", "pp2"), ("pp2", "tp2")]


def _cases():
    for transport in ("nixl", "torch_dist"):
        for src, dst in PAIRS:
            marks = [] if (transport, src, dst) in QUICK else [pytest.mark.slow]
            if transport == "nixl":
                marks.append(pytest.mark.skipif(not HAS_NIXL, reason="NIXL (nixl-cu13) is not installed"))
            yield pytest.param(transport, src, dst, id=f"{transport}-{src}-to-{dst}", marks=marks)


@pytest.mark.parametrize("transport, src, dst", list(_cases()))
def test_hybrid_workers_tokens_match_aggregated(model_dir, expected, transport, src, dst):
    flags = [*ENGINE_FLAGS, "--transport", transport]
    with (
        running_worker("prefill-worker", model_dir, *SHAPES[src], *flags) as pw,
        running_worker("decode-worker", model_dir, *SHAPES[dst], *flags) as dw,
    ):
        results, _ = disagg_generate(pw.address, dw.address, _prompts(), PARAMS)
    for (tokens, logprobs, resp), ref in zip(results, expected, strict=True):
        assert tokens == ref.generated_tokens
        assert logprobs == pytest.approx(ref.generated_log_probs, abs=1e-5)
        state = resp.handoff.state
        assert resp.handoff.HasField("state") and state.checksum
        assert (state.layout.tp, state.layout.pp, state.layout.num_layers) == (resp.handoff.layout.tp,
                                                                              resp.handoff.layout.pp, 2)
        num_pulled = len(state.endpoints)
        assert num_pulled == (state.layout.tp * state.layout.pp if transport == "nixl" else 0)
    logs = pw.output() + dw.output()
    assert "pull of" not in logs and "recomputing" not in logs, logs  # every handoff imported first time
    if transport == "torch_dist":  # KV and state pushes share one pair group for all three requests
        for worker in (pw, dw):
            assert worker.output().count("joined pair group") == 1, worker.output()


@pytest.mark.parametrize(
    "transport",
    [
        pytest.param("nixl", marks=pytest.mark.skipif(not HAS_NIXL, reason="NIXL (nixl-cu13) is not installed")),
        pytest.param("torch_dist", marks=pytest.mark.slow),
    ],
)
def test_handoff_without_state_is_recomputed(model_dir, expected, transport):
    """A descriptor that lost its state (an older prefill worker, a bad hop): the hybrid decode
    worker says so, recomputes the prompt, and still streams the aggregated tokens."""
    flags = [*ENGINE_FLAGS, "--transport", transport]
    prompt, ref = _prompts()[1], expected[1]
    with (
        running_worker("prefill-worker", model_dir, *flags) as pw,
        running_worker("decode-worker", model_dir, *flags) as dw,
        grpc.insecure_channel(pw.address) as pc,
        grpc.insecure_channel(dw.address) as dc,
    ):
        prefill = prefill_worker_pb2_grpc.PrefillWorkerStub(pc)
        decode = decode_worker_pb2_grpc.DecodeWorkerStub(dc)
        sp = sampling_to_proto(PARAMS)
        request = prefill_worker_pb2.PrefillRequest(request_id="stateless", token_ids=prompt, sampling_params=sp)
        resp = prefill.Prefill(request, timeout=60)
        assert resp.HasField("handoff") and resp.handoff.HasField("state")
        resp.handoff.ClearField("state")
        chunks = list(decode.Decode(decode_worker_pb2.DecodeRequest(
            request_id="stateless", token_ids=prompt, sampling_params=sp, handoff=resp.handoff,
            prefill_address=pw.address), timeout=60))
        assert [t for c in chunks for t in c.token_ids] == ref.generated_tokens
        assert [p for c in chunks for p in c.logprobs] == pytest.approx(ref.generated_log_probs, abs=1e-5)
        # The decode worker acked the handoff it could not use, so nothing stays pinned.
        assert not prefill.Release(prefill_worker_pb2.ReleaseRequest(request_id="stateless"), timeout=10).was_pinned
    out = dw.output()
    assert "handoff of stateless: the handoff carries no recurrent (Mamba) state and this model is hybrid; " \
           "recomputing the prompt here" in out, out
    assert "pull of" not in out  # no pull was tried
    assert "joined pair group" not in pw.output() + out
