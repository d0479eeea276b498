"""A request retried under the same id (its router died; the gateway tried again on the restarted
router) can reach the prefill worker that still pins the first attempt's handoff. The retry
supersedes it: the old pins go at once, and nothing leaks (the worker used to overwrite the
handoff table's entry and keep the first attempt's blocks pinned with no owner, for good).
Real worker process, with layer-wise streaming (progress slots) and NIXL."""

import grpc
import torch

from splitserve import SamplingParams
from splitserve.engine.wire import sampling_to_proto
from splitserve.proto.v1 import common_pb2, prefill_worker_pb2, prefill_worker_pb2_grpc
from tests.fixtures.models import build_hf_checkpoint
from tests.fixtures.workers import running_worker

PARAMS = SamplingParams(num_tokens_to_generate=8, temperature=0.0)


def test_a_retried_request_id_supersedes_the_pinned_handoff_of_its_earlier_attempt(tmp_path):
    build_hf_checkpoint(tmp_path, "llama", num_hidden_layers=2)
    prompt = torch.randint(3, 512, (37,), generator=torch.Generator().manual_seed(5)).tolist()
    blocks = -(-len(prompt) // 8)
    flags = ["--block-size", "8", "--num-blocks", "128", "--transport", "nixl"]
    with running_worker("prefill-worker", str(tmp_path), *flags) as worker, grpc.insecure_channel(worker.address) as ch:
        stub = prefill_worker_pb2_grpc.PrefillWorkerStub(ch)
        request = prefill_worker_pb2.PrefillRequest(request_id="again", token_ids=prompt,
                                                    sampling_params=sampling_to_proto(PARAMS))  # fmt: skip
        first = [e for e in stub.PrefillStream(request, timeout=60) if e.WhichOneof("event") == "response"][0]
        second = [e for e in stub.PrefillStream(request, timeout=60) if e.WhichOneof("event") == "response"][0]
        assert second.response.handoff.first_token_id == first.response.handoff.first_token_id
        report = stub.CheckIntegrity(common_pb2.IntegrityRequest(), timeout=10)
        assert report.is_ok, report.problem  # was: "block N: ref count 1 but 0 owners"
        assert report.num_pinned_blocks == blocks  # the retry's handoff only
        assert stub.Release(prefill_worker_pb2.ReleaseRequest(request_id="again"), timeout=10).was_pinned
        report = stub.CheckIntegrity(common_pb2.IntegrityRequest(), timeout=10)
        assert report.is_ok and report.num_pinned_blocks == 0 and report.num_in_use_blocks == 0, report
