"""`--pack-for-tp`: a real tp=1 prefill worker packs each handoff's head slices for a tp=2 decode
worker (engine/handoff_pack.py) and publishes the packed memory in the preview and descriptor; the
decode worker reads it over real NIXL — the aggregated engine's tokens and log-probs, through the
unary flow (Prefill → Decode) and the layer-wise one (PrefillStream → Prefetch → Decode)."""

import importlib.util
import subprocess
import sys

import pytest
import torch

from splitserve import LLM, SamplingParams
from tests.fixtures.models import build_hf_checkpoint
from tests.fixtures.workers import disagg_generate, running_worker, streamed_generate

pytestmark = pytest.mark.skipif(importlib.util.find_spec("nixl_cu13") is None, reason="NIXL (nixl-cu13) is not installed")

ENGINE_FLAGS = ["--block-size", "8", "--num-blocks", "256", "--max-tokens", "64", "--transport", "nixl"]
PARAMS = SamplingParams(num_tokens_to_generate=8, temperature=0.0, return_log_probs=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("packed")
    build_hf_checkpoint(path, "llama", num_hidden_layers=2)  # 2 kv heads: one per decode rank at tp=2
    return str(path)


def _prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (9, 33)]


@pytest.fixture(scope="module")
def expected(model_dir):
    return LLM(model_dir, block_size_tokens=8, num_blocks=256).generate(_prompts(), PARAMS)


def _stream_once(address, prompt, request_id="once", decode_tp=0):
    import grpc

    from splitserve.engine.wire import sampling_to_proto
    from splitserve.proto.v1 import prefill_worker_pb2, prefill_worker_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = prefill_worker_pb2_grpc.PrefillWorkerStub(channel)
        events = list(stub.PrefillStream(
            prefill_worker_pb2.PrefillRequest(request_id=request_id, token_ids=prompt, decode_tp=decode_tp,
                                              sampling_params=sampling_to_proto(PARAMS)), timeout=60))
        stub.Release(prefill_worker_pb2.ReleaseRequest(request_id=request_id), timeout=10)
    return events[0].handoff_started, events[-1].response


def _packed_groups(agent_metadata: bytes):
    from splitserve.engine.transfer.nixl_endpoint import NixlEndpoint

    packed = NixlEndpoint.from_bytes(agent_metadata).packed
    return None if packed is None else [(g.head_start, g.num_heads) for g in packed.groups]


@pytest.mark.parametrize("layerwise", [False, True], ids=["unary", "layerwise"])
def test_a_packed_handoff_gives_the_aggregated_tokens(model_dir, expected, layerwise):
    flags = [*ENGINE_FLAGS, "--layerwise" if layerwise else "--no-layerwise"]
    with (
        running_worker("prefill-worker", model_dir, "--tp", "1", "--pack-for-tp", "2", *flags) as pw,
        running_worker("decode-worker", model_dir, "--tp", "2", *flags) as dw,
    ):
        if layerwise:
            results = streamed_generate(pw.address, dw.address, _prompts(), PARAMS)
            outs = [(tokens, logprobs) for tokens, logprobs, *_ in results]
            for _, _, kinds, prefetch, timing in results:
                assert kinds == ["handoff_started", "first_token", "response"]
                assert prefetch.accepted, prefetch.reason
                assert timing.prefetched  # the prefetched (packed) layers passed the block checksums
            preview, response = _stream_once(pw.address, _prompts()[1])
            for handoff in (preview, response.handoff):
                assert _packed_groups(handoff.rank_endpoints[0].agent_metadata) == [(0, 1), (1, 1)]
        else:
            results, _ = disagg_generate(pw.address, dw.address, _prompts(), PARAMS)
            outs = [(tokens, logprobs) for tokens, logprobs, _ in results]
            for *_, resp in results:
                assert _packed_groups(resp.handoff.rank_endpoints[0].agent_metadata) == [(0, 1), (1, 1)]
    for (tokens, logprobs), ref in zip(outs, expected, strict=True):
        assert tokens == ref.generated_tokens
        assert logprobs == pytest.approx(ref.generated_log_probs, abs=1e-5)


def test_a_hybrid_model_s_packed_layerwise_handoff_gives_the_aggregated_tokens(tmp_path):
    """NemotronH (Mamba2 + attention): the layer listener sees only the attention layers, so the
    step's end packs the rest — outside the forward pass's inference mode, into a job begun inside
    it. That crashed the prefill worker's engine loop on every such handoff."""
    from tests.fixtures.models import build_hybrid_checkpoint

    build_hybrid_checkpoint(tmp_path)
    model = str(tmp_path)
    expected = LLM(model, block_size_tokens=8, num_blocks=256).generate(_prompts(), PARAMS)
    with (
        running_worker("prefill-worker", model, "--tp", "1", "--pack-for-tp", "2", *ENGINE_FLAGS) as pw,
        running_worker("decode-worker", model, "--tp", "2", *ENGINE_FLAGS) as dw,
    ):
        results = streamed_generate(pw.address, dw.address, _prompts(), PARAMS)
    for (tokens, logprobs, *_), ref in zip(results, expected, strict=True):
        assert tokens == ref.generated_tokens
        assert logprobs == pytest.approx(ref.generated_log_probs, abs=1e-5)


def test_the_decode_tp_named_per_request_decides_what_is_packed(model_dir):
    """The router names the chosen decode worker's TP (PrefillRequest.decode_tp): a tp=1 decode
    worker needs nothing packed, one the model's kv heads do not fit gets the pool as is (the
    worker warns and serves on), and a request naming none is packed for --pack-for-tp."""
    prompt = _prompts()[1]
    with running_worker("prefill-worker", model_dir, "--tp", "1", "--pack-for-tp", "2", *ENGINE_FLAGS) as pw:
        for request_id, decode_tp, groups in (("named-1", 1, None), ("named-3", 3, None), ("named-2", 2, [(0, 1), (1, 1)]),
                                              ("unnamed", 0, [(0, 1), (1, 1)])):
            preview, response = _stream_once(pw.address, prompt, request_id, decode_tp)
            for handoff in (preview, response.handoff):
                assert _packed_groups(handoff.rank_endpoints[0].agent_metadata) == groups, request_id


def test_pack_for_tp_is_refused_where_it_cannot_work(model_dir):
    """A model whose 2 kv heads do not split over tp=3, and a transport without packing: the worker
    exits at start with the reason, not a traceback."""
    for extra, reason in ((["--pack-for-tp", "3"], "pack_for_tp=3 does not fit this model"),
                          (["--pack-for-tp", "2", "--transport", "shm"], "--pack-for-tp needs --transport nixl")):
        proc = subprocess.run(
            [sys.executable, "-m", "splitserve", "prefill-worker", "--model", model_dir, *ENGINE_FLAGS, *extra],
            capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0
        assert reason in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
