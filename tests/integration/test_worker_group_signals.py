"""A tensor-parallel worker is several processes in one process group; supervisors (`splitserve
up`, a terminal's Ctrl-C) signal the whole group. Only rank 0 acts on SIGTERM — it drains, which
needs every rank for each command and step — and the other ranks end with it."""

import os
import signal
import time

import grpc

from splitserve import SamplingParams
from splitserve.engine.wire import sampling_to_proto
from splitserve.proto.v1 import prefill_worker_pb2, prefill_worker_pb2_grpc
from tests.fixtures.models import build_hf_checkpoint
from tests.fixtures.workers import running_worker, wait_for

FLAGS = ("--tp", "2", "--transport", "torch_dist", "--num-blocks", "64", "--handoff-lease-s", "60", "--no-warm-up")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_to_a_tp2_group_drains_on_every_rank_then_exits_zero(tmp_path):
    """SIGTERM to every process of a tp=2 prefill worker holding a pin: it keeps serving the drain
    (a Release is an engine command on both ranks), then exits 0 with no crash logged."""
    build_hf_checkpoint(tmp_path, "llama", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    params = sampling_to_proto(SamplingParams(num_tokens_to_generate=8, temperature=0.0))
    with running_worker("prefill-worker", str(tmp_path), *FLAGS) as worker:
        with grpc.insecure_channel(worker.address) as ch:
            stub = prefill_worker_pb2_grpc.PrefillWorkerStub(ch)
            req = prefill_worker_pb2.PrefillRequest(request_id="pinned", token_ids=list(range(5, 30)),
                                                    sampling_params=params)
            assert stub.Prefill(req, timeout=60).HasField("handoff")
            os.killpg(worker.proc.pid, signal.SIGTERM)  # rank 0 and rank 1 alike, as `splitserve up` does
            time.sleep(1.5)
            assert worker.proc.poll() is None, worker.output()  # draining: waiting for its pin
            assert stub.Release(prefill_worker_pb2.ReleaseRequest(request_id="pinned"), timeout=10).was_pinned
        assert worker.proc.wait(timeout=30) == 0, worker.output()
        assert "crashed" not in worker.output()
        wait_for(lambda: not _group_alive(worker.proc.pid), 10, "rank 1 did not exit with rank 0")


def test_other_ranks_end_when_rank_zero_is_killed(tmp_path):
    """SIGKILL to rank 0 alone (no drain, no "stop" command): rank 1, which ignores SIGTERM, exits
    too (over gloo its broken connection already ends it; the rank's watchdog covers a rank that
    is not inside a collective that notices)."""
    build_hf_checkpoint(tmp_path, "llama", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    with running_worker("prefill-worker", str(tmp_path), *FLAGS) as worker:
        worker.proc.kill()
        worker.proc.wait(timeout=10)
        wait_for(lambda: not _group_alive(worker.proc.pid), 15, "rank 1 outlived rank 0")
