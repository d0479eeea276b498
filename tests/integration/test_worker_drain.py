"""Graceful drain of a prefill worker: on SIGTERM it refuses new prefills but
waits for its pinned KV to be pulled (Release) before exiting 0."""

import signal
import time

import grpc
import pytest

from splitserve import SamplingParams
from splitserve.engine.wire import sampling_to_proto
from splitserve.proto.v1 import prefill_worker_pb2, prefill_worker_pb2_grpc
from tests.fixtures.models import build_hf_checkpoint
from tests.fixtures.workers import running_worker

pytest.importorskip("nixl_cu13")


def test_prefill_drain_waits_for_pins_then_exits_zero(tmp_path):
    build_hf_checkpoint(tmp_path, "llama", num_hidden_layers=2)
    params = sampling_to_proto(SamplingParams(num_tokens_to_generate=8, temperature=0.0))
    with running_worker("prefill-worker", str(tmp_path), "--num-blocks", "64", "--handoff-lease-s", "60") as worker:
        with grpc.insecure_channel(worker.address) as ch:
            stub = prefill_worker_pb2_grpc.PrefillWorkerStub(ch)
            req = prefill_worker_pb2.PrefillRequest(request_id="pinned", token_ids=list(range(5, 30)), sampling_params=params)
            assert stub.Prefill(req, timeout=30).HasField("handoff")
            worker.proc.send_signal(signal.SIGTERM)
            time.sleep(1.5)
            assert worker.proc.poll() is None  # still waiting for its pins
            with pytest.raises(grpc.RpcError) as err:
                stub.Prefill(prefill_worker_pb2.PrefillRequest(request_id="late", token_ids=[5, 6], sampling_params=params), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
            assert stub.Release(prefill_worker_pb2.ReleaseRequest(request_id="pinned"), timeout=10).was_pinned
        assert worker.proc.wait(timeout=30) == 0
