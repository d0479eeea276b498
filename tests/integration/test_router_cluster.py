"""The router in front of real workers: etcd + control plane + prefill + decode
workers + router. Requests through `Router.Generate` give the aggregated
engine's tokens; KV events from the workers let the router predict prefix hits."""

import grpc
import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.wire import sampling_to_proto
from splitserve.proto.v1 import router_pb2, router_pb2_grpc
from tests.fixtures.cluster import LocalCluster, wait_for
from tests.fixtures.models import build_hf_checkpoint

pytest.importorskip("nixl_cu13")
pytest.importorskip("zmq")

FLAGS = ["--block-size", "8", "--num-blocks", "256"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("routed")
    model = tmp / "model"
    model.mkdir()
    build_hf_checkpoint(model, "llama", num_hidden_layers=2)
    workers = [("prefill-worker", FLAGS), ("prefill-worker", FLAGS), ("decode-worker", FLAGS)]
    router_flags = ["--block-size", "8", "--disagg-min-uncached-tokens", "1", "--policy", "longest_prefix"]
    spec = "tp=1,dp=2,role=prefill+tp=1,role=decode"
    with LocalCluster(tmp, str(model), spec, workers, router_flags=router_flags) as c:
        yield c


def _generate(address, rid, prompt, params):
    tokens, last = [], None
    with grpc.insecure_channel(address) as ch:
        req = router_pb2.GenerateRequest(request_id=rid, token_ids=prompt, sampling_params=sampling_to_proto(params))
        for chunk in router_pb2_grpc.RouterStub(ch).Generate(req, timeout=60):
            tokens += chunk.token_ids
            last = chunk
    return tokens, last


def test_routed_requests_match_aggregated_and_use_kv_events(cluster):
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 512, (40,), generator=g).tolist()
    prompts = [shared + [7, 8, 9], shared + [11, 12, 13, 14, 15]]
    params = SamplingParams(num_tokens_to_generate=8, temperature=0.0)
    expected = LLM(cluster.model, block_size_tokens=8, num_blocks=256).generate(prompts, params)

    tokens, last = _generate(cluster.router, "first", prompts[0], params)
    assert tokens == expected[0].generated_tokens
    assert last.routing.prefill_worker_id and last.routing.decode_worker_id  # disaggregated
    assert last.usage.prompt_tokens == 43 and last.usage.completion_tokens == 8

    # The prefill worker's BlockStored events reach the router's index; the second
    # prompt shares 5 full blocks, which the router predicts and the worker confirms.
    def predicted():
        _, chunk = _generate(cluster.router, f"probe-{predicted.n}", prompts[1], params)
        predicted.n += 1
        return chunk if chunk.routing.predicted_cached_tokens >= 40 else None

    predicted.n = 0
    holder = last.routing.prefill_worker_id
    last = wait_for(predicted, 20, "router never predicted the cached prefix")
    assert last.usage.cached_tokens >= 40
    # Of the two prefill workers, prefix-sharing prompts land on the one holding the prefix.
    assert last.routing.prefill_worker_id == holder
    tokens, last = _generate(cluster.router, "second", prompts[1], params)
    assert tokens == expected[1].generated_tokens
    assert last.routing.prefill_worker_id == holder and last.usage.cached_tokens >= 40
    # A prompt with another prefix may go anywhere; one sharing the first prefix still goes to the holder.
    other = torch.randint(3, 512, (40,), generator=g).tolist()
    _generate(cluster.router, "other", other, params)
    _, last = _generate(cluster.router, "third", shared + [20, 21], params)
    assert last.routing.prefill_worker_id == holder
