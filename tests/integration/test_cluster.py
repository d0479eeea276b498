"""A real cluster: etcd + control plane + prefill (tp=2) + decode (tp=1) worker
processes that take their slots from `--inference-shards`; a request driven
through the worker RPCs gives the aggregated engine's tokens; a SIGTERMed
decode worker finishes its in-flight stream, deregisters and exits 0."""

import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.wire import sampling_to_proto
from splitserve.proto.v1 import (
    control_plane_pb2,
    control_plane_pb2_grpc,
    decode_worker_pb2,
    decode_worker_pb2_grpc,
)
from tests.fixtures.etcd import EtcdServer, free_port
from tests.fixtures.models import build_hf_checkpoint
from tests.fixtures.workers import WorkerProcess, disagg_generate

pytest.importorskip("nixl_cu13")

SPEC = "tp=2,role=prefill+tp=1,role=decode"
FLAGS = ["--block-size", "8", "--num-blocks", "256", "--cluster", "itest"]


def _topology(address):
    with grpc.insecure_channel(address) as ch:
        return control_plane_pb2_grpc.ControlPlaneStub(ch).GetTopology(control_plane_pb2.GetTopologyRequest(), timeout=5)


def _wait(predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(what)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cluster")
    model = tmp / "model"
    model.mkdir()
    build_hf_checkpoint(model, "llama", num_hidden_layers=2)
    etcd = EtcdServer(tmp / "etcd")
    etcd.start()
    cp_address = f"127.0.0.1:{free_port()}"
    cp = subprocess.Popen(
        [sys.executable, "-m", "splitserve", "control-plane", "--etcd", etcd.endpoint, "--inference-shards", SPEC,
         "--listen", cp_address, "--cluster", "itest"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )
    workers = []
    try:
        _wait(lambda: _try_topology(cp_address), 30, "control plane did not start")
        etcd_flags = ["--etcd", etcd.endpoint, *FLAGS]
        workers.append(WorkerProcess("prefill-worker", str(model), "--tp", "2", *etcd_flags))
        workers.append(WorkerProcess("decode-worker", str(model), *etcd_flags))
        yield dict(model=str(model), cp=cp_address, prefill=workers[0], decode=workers[1])
    finally:
        for w in workers:
            w.stop()
            w.kill()
        cp.terminate()
        cp.wait(timeout=20)
        etcd.stop()


def _try_topology(address):
    try:
        return _topology(address)
    except grpc.RpcError:
        return None


def test_workers_take_the_slots_the_spec_defines(cluster):
    topo = _wait(lambda: (t := _topology(cluster["cp"])) and all(s.worker_id for s in t.slots) and t, 30, "slots not filled")
    by_worker = {}
    for slot in topo.slots:
        by_worker.setdefault(slot.worker_id, []).append(slot)
    assert len(by_worker) == 2
    addresses = {w.worker_id: w.address for w in topo.workers}
    prefill_slots = next(s for wid, s in by_worker.items() if addresses[wid] == cluster["prefill"].address)
    assert [(s.slot.tp, s.slot.tp_rank) for s in prefill_slots] == [(2, 0), (2, 1)]
    decode_slots = next(s for wid, s in by_worker.items() if addresses[wid] == cluster["decode"].address)
    assert [(s.slot.tp, s.slot.tp_rank) for s in decode_slots] == [(1, 0)]


def test_request_through_the_cluster_matches_aggregated(cluster):
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (9, 33)]
    params = SamplingParams(num_tokens_to_generate=10, temperature=0.0)
    expected = LLM(cluster["model"], block_size_tokens=8, num_blocks=256).generate(prompts, params)
    results, _ = disagg_generate(cluster["prefill"].address, cluster["decode"].address, prompts, params)
    assert [r[0] for r in results] == [e.generated_tokens for e in expected]
    assert all(r[2].handoff.layout.tp == 2 for r in results)


def test_sigterm_drains_in_flight_work_then_exits_zero(cluster):
    decode = cluster["decode"]
    params = sampling_to_proto(SamplingParams(num_tokens_to_generate=60, temperature=0.0, ignore_eos=True))
    got: list[int] = []
    errors: list[Exception] = []
    first = threading.Event()

    def stream():
        try:
            with grpc.insecure_channel(decode.address) as ch:
                req = decode_worker_pb2.DecodeRequest(request_id="drain", token_ids=[5, 6, 7], sampling_params=params)
                for chunk in decode_worker_pb2_grpc.DecodeWorkerStub(ch).Decode(req, timeout=60):
                    got.extend(chunk.token_ids)
                    first.set()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            first.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert first.wait(30)
    assert decode.stop(timeout_s=60) == 0
    thread.join(30)
    assert not errors and len(got) == 60
    topo = _wait(lambda: (t := _topology(cluster["cp"])) and all(w.address != decode.address for w in t.workers) and t, 15, "not deregistered")
    assert topo is not None


def _lifecycle(address, action, path=""):
    with grpc.insecure_channel(address) as ch:
        stub = control_plane_pb2_grpc.ControlPlaneStub(ch)
        stub.Lifecycle(control_plane_pb2.LifecycleRequest(action=action, checkpoint_path=path), timeout=10)


def test_pause_suspend_reload_resume_reach_every_worker(cluster, tmp_path):
    """Runs after the drain test: only the prefill worker is left; drive it directly."""
    from splitserve.proto.v1 import prefill_worker_pb2, prefill_worker_pb2_grpc

    prefill = cluster["prefill"]
    params = sampling_to_proto(SamplingParams(num_tokens_to_generate=4, temperature=0.0))
    request = prefill_worker_pb2.PrefillRequest(request_id="p1", token_ids=[5, 6, 7, 8], sampling_params=params)
    with grpc.insecure_channel(prefill.address) as ch:
        stub = prefill_worker_pb2_grpc.PrefillWorkerStub(ch)
        first = stub.Prefill(request, timeout=30).handoff.first_token_id
        _lifecycle(cluster["cp"], control_plane_pb2.LIFECYCLE_ACTION_PAUSE)
        time.sleep(0.5)
        future = stub.Prefill.future(prefill_worker_pb2.PrefillRequest(request_id="p2", token_ids=[5, 6, 7, 8], sampling_params=params), timeout=30)
        time.sleep(1.0)
        assert not future.done()  # paused: queued, not scheduled
        new_model = tmp_path / "v2"
        hf = build_hf_checkpoint(new_model, "llama", num_hidden_layers=2, seed=99)
        _lifecycle(cluster["cp"], control_plane_pb2.LIFECYCLE_ACTION_SUSPEND)
        _lifecycle(cluster["cp"], control_plane_pb2.LIFECYCLE_ACTION_RELOAD_WEIGHTS, str(new_model))
        _lifecycle(cluster["cp"], control_plane_pb2.LIFECYCLE_ACTION_RESUME)
        _lifecycle(cluster["cp"], control_plane_pb2.LIFECYCLE_ACTION_UNPAUSE)
        second = future.result(timeout=30).handoff.first_token_id
    expected = int(hf(torch.tensor([[5, 6, 7, 8]])).logits[0, -1].argmax())
    assert second == expected
    assert first != second or expected == first
