"""A worker whose engine loop crashes does not hang its requests: the calls end with an error at
once (the router retries them elsewhere), and the process exits 1 so that a supervisor
(`splitserve up`, Kubernetes) restarts it. The crash comes from the test hook
(engine/fault_injection.py, phase "crash")."""

from __future__ import annotations

import time

import grpc
import pytest

from splitserve import SamplingParams
from splitserve.engine.default_model import default_model_path
from splitserve.engine.wire import sampling_to_proto
from splitserve.proto.v1 import prefill_worker_pb2, prefill_worker_pb2_grpc
from tests.fixtures.workers import WorkerProcess


def test_a_crashed_engine_loop_fails_the_call_and_exits_1(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_FAULT_DELAY_MS", "crash=0")
    worker = WorkerProcess("prefill-worker", str(default_model_path()), "--transport", "inproc")
    try:
        params = sampling_to_proto(SamplingParams(num_tokens_to_generate=4, temperature=0.0))
        started = time.monotonic()
        with grpc.insecure_channel(worker.address) as channel, pytest.raises(grpc.RpcError) as error:
            prefill_worker_pb2_grpc.PrefillWorkerStub(channel).Prefill(
                prefill_worker_pb2.PrefillRequest(request_id="r", token_ids=[5, 6, 7], sampling_params=params), timeout=60
            )
        assert error.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert time.monotonic() - started < 15  # not the 120 s Prefill timeout
        assert worker.proc.wait(timeout=30) == 1
        output = worker.output()
        assert "engine loop crashed" in output and "exiting so that it is restarted" in output
    finally:
        worker.kill()
