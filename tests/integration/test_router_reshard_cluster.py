"""A reshard behind the router, with the defaults: etcd + control plane + a tp=1 NIXL prefill
worker + a tp=2 decode worker + router. The prefill worker turns packing on by itself
(`--pack-for-tp auto`: the shard spec has a tp=2 decode group) and the router names the decode
worker's TP per request; the tokens are the aggregated engine's."""

import grpc
import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.wire import sampling_to_proto
from splitserve.proto.v1 import router_pb2, router_pb2_grpc
from tests.fixtures.cluster import LocalCluster
from tests.fixtures.models import build_hf_checkpoint

pytest.importorskip("nixl_cu13")
pytest.importorskip("zmq")

FLAGS = ["--block-size", "8", "--num-blocks", "256"]


def test_a_routed_reshard_is_packed_by_default_and_matches_aggregated(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    build_hf_checkpoint(model, "llama", num_hidden_layers=2)  # 2 kv heads: one per decode rank
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (21, 40)]
    params = SamplingParams(num_tokens_to_generate=6, temperature=0.0)
    expected = LLM(str(model), block_size_tokens=8, num_blocks=256).generate(prompts, params)
    workers = [("prefill-worker", FLAGS), ("decode-worker", [*FLAGS, "--tp", "2"])]
    router_flags = ["--block-size", "8", "--disagg-min-uncached-tokens", "1"]
    with LocalCluster(tmp_path, str(model), "tp=1,role=prefill+tp=2,role=decode", workers,
                      router_flags=router_flags) as cluster:
        with grpc.insecure_channel(cluster.router) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            for i, (prompt, ref) in enumerate(zip(prompts, expected, strict=True)):
                message = router_pb2.GenerateRequest(request_id=f"r{i}", token_ids=prompt,
                                                     sampling_params=sampling_to_proto(params))
                chunks = list(stub.Generate(message, timeout=60))
                assert [t for c in chunks for t in c.token_ids] == ref.generated_tokens
                assert chunks[-1].routing.prefill_worker_id  # disaggregated: the KV went tp 1 -> 2
        assert "packing handoffs for decode TP sizes the router names (default tp=2)" in cluster.workers[0].output()
