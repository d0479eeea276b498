"""Real prefill and decode worker processes, driven over gRPC the way the router
drives them: Prefill → HandoffDescriptor → Decode (NIXL pull, or a torch_dist push
over gloo; checksums) → tokens identical to the aggregated engine, log-probs within
1e-5, and the prefill side's pins released.

Every (prefill tp, pp) × (decode tp, pp) in {1, 2} × {1, 2} runs with both
transports; two combinations per transport run in the default stage, the rest
(and TP 4 ↔ 1, where the model's 2 kv heads are replicated) are marked slow. The
model is GQA: 4 query heads, 2 kv heads, 2 layers."""

import importlib.util
import time

import grpc
import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.wire import sampling_to_proto
from splitserve.proto.v1 import (
    common_pb2,
    decode_worker_pb2,
    decode_worker_pb2_grpc,
    prefill_worker_pb2,
    prefill_worker_pb2_grpc,
)
from tests.fixtures.models import build_hf_checkpoint
from tests.fixtures.workers import disagg_generate, running_worker

HAS_NIXL = importlib.util.find_spec("nixl_cu13") is not None
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


def _aggregated(model_dir, device="auto"):
    """The aggregated engine's results for `_prompts()`: what every disaggregated run must give."""
    return LLM(model_dir, device=device, block_size_tokens=8, num_blocks=256).generate(_prompts(), PARAMS)


@pytest.fixture(scope="module")
def expected(model_dir):
    return _aggregated(model_dir)


SHAPES = {
    "tp1": ["--tp", "1"],
    "tp2": ["--tp", "2"],
    "pp2": ["--pp", "2"],
    "tp2pp2": ["--tp", "2", "--pp", "2"],
    "tp4": ["--tp", "4"],
}
QUICK = {("nixl", "tp1", "tp1"), ("nixl", "tp2", "tp1"), ("torch_dist", "tp1", "tp1"), ("torch_dist", "tp2", "pp2")}
PAIRS = [(s, d) for s in ("tp1", "tp2", "pp2", "tp2pp2") for d in ("tp1", "tp2", "pp2", "tp2pp2")]
PAIRS += [("tp4", "tp1"), ("tp1", "tp4")]  # kv heads (2) fewer than the TP size: replicated heads


HAS_CUDA = torch.cuda.is_available()


def _size(shape: str, dim: str) -> int:
    flags = SHAPES[shape]
    return int(flags[flags.index(f"--{dim}") + 1]) if f"--{dim}" in flags else 1


def _cases():
    for transport in ("nixl", "torch_dist"):
        for src, dst in PAIRS:
            marks = [] if (transport, src, dst) in QUICK else [pytest.mark.slow]
            if transport == "nixl":  # the workers run on the CPU on GPU hosts too (tests/conftest.py)
                marks.append(pytest.mark.skipif(not HAS_NIXL, reason="NIXL (nixl-cu13) is not installed"))
            yield pytest.param(transport, src, dst, id=f"{transport}-{src}-to-{dst}", marks=marks)
    # Same-host GPU pairs: both workers on one GPU (`--device cuda`), KV mapped over CUDA IPC (GPU hosts only).
    for src, dst in (("tp1", "tp1"),):
        marks = [pytest.mark.skipif(not HAS_CUDA, reason="CUDA IPC needs a GPU")]
        yield pytest.param("cuda_ipc", src, dst, id=f"cuda_ipc-{src}-to-{dst}", marks=marks)


@pytest.mark.parametrize("transport, src, dst", list(_cases()))
def test_disaggregated_tokens_match_aggregated(model_dir, expected, transport, src, dst):
    flags = [*ENGINE_FLAGS, "--transport", transport]
    if transport == "cuda_ipc":  # on the GPU, against the aggregated engine on the GPU
        flags += ["--device", "cuda"]
        expected = _aggregated(model_dir, device="cuda")
    with (
        running_worker("prefill-worker", model_dir, *SHAPES[src], *flags) as pw,
        running_worker("decode-worker", model_dir, *SHAPES[dst], *flags) as dw,
    ):
        results, blocks = disagg_generate(pw.address, dw.address, _prompts(), PARAMS)
    for (tokens, logprobs, resp), ref in zip(results, expected, strict=True):
        assert tokens == ref.generated_tokens
        assert logprobs == pytest.approx(ref.generated_log_probs, abs=1e-5)
        assert resp.handoff.transport_kind == transport
        assert (resp.handoff.layout.tp, resp.handoff.layout.pp) == (_size(src, "tp"), _size(src, "pp"))
        assert len(resp.handoff.block_checksums) == len(resp.handoff.rank_blocks[0].block_ids)
    assert blocks.block_size == 8 and len(blocks.block_digests) >= 3 + 5  # full prompt blocks are cached
    if transport == "torch_dist":  # one pair group for all three requests, on both sides
        for worker in (pw, dw):
            assert worker.output().count("joined pair group") == 1, worker.output()
            assert "WARNING" not in worker.output(), worker.output()


def test_torch_dist_push_that_cannot_happen_falls_back_to_recompute(model_dir, expected):
    """PushKV refused (the handoff was already released) or unreachable: the decode worker
    retries, then recomputes the prompt; the client still gets the aggregated tokens."""
    flags = [*ENGINE_FLAGS, "--transport", "torch_dist"]
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
        for rid, address in (("released", pw.address), ("unreachable", "127.0.0.1:1")):
            resp = prefill.Prefill(prefill_worker_pb2.PrefillRequest(request_id=rid, token_ids=prompt, sampling_params=sp), timeout=60)
            if rid == "released":
                assert prefill.Release(prefill_worker_pb2.ReleaseRequest(request_id=rid), timeout=10).was_pinned
            request = decode_worker_pb2.DecodeRequest(
                request_id=rid, token_ids=prompt, sampling_params=sp, handoff=resp.handoff, prefill_address=address
            )
            chunks = list(decode.Decode(request, timeout=60))
            assert [t for c in chunks for t in c.token_ids] == ref.generated_tokens
            assert [p for c in chunks for p in c.logprobs] == pytest.approx(ref.generated_log_probs, abs=1e-5)
        # The decode worker could not reach this prefill worker to ack, so the pin is still ours to drop.
        assert prefill.Release(prefill_worker_pb2.ReleaseRequest(request_id="unreachable"), timeout=10).was_pinned
    assert dw.output().count("pull of") == 4  # two failed attempts per request, then the recompute
    assert "has no pinned handoff" in dw.output() and "UNAVAILABLE" in dw.output()
    assert "joined pair group" not in pw.output() + dw.output()


@pytest.mark.skipif(not HAS_NIXL, reason="NIXL (nixl-cu13) is not installed")
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


@pytest.mark.skipif(not HAS_NIXL, reason="NIXL (nixl-cu13) is not installed")
def test_prefill_stream_sends_the_first_token_then_the_unary_response(model_dir, expected, tmp_path, monkeypatch):
    """PrefillStream: a first_token event, then a response whose handoff Decode uses like the unary
    one's (same tokens as Prefill and as the aggregated engine); a first token that ends the request
    says so; a stream cancelled after its first token leaves nothing pinned on the prefill worker."""
    prompts = _prompts()[:2]
    faults = tmp_path / "faults"  # engine/fault_injection.py: read at every check, absent = no delay
    monkeypatch.setenv("SPLITSERVE_FAULT_DELAY_FILE", str(faults))
    with (
        running_worker("prefill-worker", model_dir, *ENGINE_FLAGS, "--no-layerwise") as pw,  # no preview event
        running_worker("decode-worker", model_dir, *ENGINE_FLAGS, "--no-layerwise") as dw,
    ):
        unary, _ = disagg_generate(pw.address, dw.address, prompts, PARAMS)
        with grpc.insecure_channel(pw.address) as pc, grpc.insecure_channel(dw.address) as dc:
            prefill = prefill_worker_pb2_grpc.PrefillWorkerStub(pc)
            decode = decode_worker_pb2_grpc.DecodeWorkerStub(dc)
            sp = sampling_to_proto(PARAMS)
            for i, (prompt, (tokens, _, _), ref) in enumerate(zip(prompts, unary, expected, strict=False)):
                rid = f"s{i}"
                request = prefill_worker_pb2.PrefillRequest(request_id=rid, token_ids=prompt, sampling_params=sp)
                events = list(prefill.PrefillStream(request, timeout=60))
                assert [e.WhichOneof("event") for e in events] == ["first_token", "response"]
                first, response = events[0].first_token, events[1].response
                assert first.token_id == ref.generated_tokens[0] == response.handoff.first_token_id
                assert first.logprob == pytest.approx(ref.generated_log_probs[0], abs=1e-5)
                assert first.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
                timing = response.timing
                assert 0 < timing.first_token_ms <= timing.handler_ms and timing.publish_ms >= 0
                chunks = list(decode.Decode(decode_worker_pb2.DecodeRequest(
                    request_id=rid, token_ids=prompt, sampling_params=sp, handoff=response.handoff,
                    prefill_address=pw.address), timeout=60))  # fmt: skip
                assert [t for c in chunks for t in c.token_ids] == tokens == ref.generated_tokens

            one = sampling_to_proto(SamplingParams(num_tokens_to_generate=1, temperature=0.0))
            request = prefill_worker_pb2.PrefillRequest(request_id="one", token_ids=prompts[0], sampling_params=one)
            first, last = list(prefill.PrefillStream(request, timeout=60))
            assert first.first_token.token_id == expected[0].generated_tokens[0]
            assert first.first_token.finish_reason == last.response.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert not last.response.HasField("handoff")

            faults.write_text("prefill=20000")  # pinned, response held back: the cancel comes first
            request = prefill_worker_pb2.PrefillRequest(request_id="gone", token_ids=prompts[1], sampling_params=sp)
            stream = prefill.PrefillStream(request, timeout=60)
            assert next(stream).WhichOneof("event") == "first_token"
            deadline = time.monotonic() + 10
            while "holds request gone in phase prefill" not in pw.output():
                assert time.monotonic() < deadline, pw.output()
                time.sleep(0.05)
            stream.cancel()
            deadline = time.monotonic() + 5  # well before the hold would have ended
            while (report := prefill.CheckIntegrity(common_pb2.IntegrityRequest(), timeout=10)).num_pinned_blocks:
                assert time.monotonic() < deadline, report
                time.sleep(0.05)
            assert report.is_ok and report.num_requests == 0 and report.num_handoffs == 0, report
