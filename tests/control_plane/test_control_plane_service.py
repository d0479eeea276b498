"""The ControlPlane gRPC service in-process, against a real etcd, with real WorkerRegistrations."""

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.control_plane.assignment import Peer
from splitserve.control_plane.cluster_store import ClusterStore
from splitserve.control_plane.errors import SpecMismatchError
from splitserve.control_plane.etcd_client import connect
from splitserve.control_plane.lifecycle import LifecycleAction, LifecycleState, LifecycleStatus
from splitserve.control_plane.server import SERVICE_NAME
from splitserve.control_plane.service import LEADER_ADDRESS_METADATA, action_to_proto, lifecycle_from_proto
from splitserve.control_plane.shard_spec import Role, parse_inference_shards
from splitserve.proto.v1 import control_plane_pb2
from tests.control_plane.helpers import (
    TTL_S,
    TopologyWatcher,
    cp_config,
    get_topology,
    make_worker,
    running_control_plane,
    stub,
)


async def test_four_workers_get_exactly_the_spec_slots(etcd_server, cluster_keys):
    endpoint = etcd_server.endpoint
    async with running_control_plane(cp_config(endpoint, cluster_keys)) as cp:
        workers = [
            make_worker(endpoint, cluster_keys, 0, Role.DECODE),
            make_worker(endpoint, cluster_keys, 1, Role.PREFILL),
            make_worker(endpoint, cluster_keys, 2, Role.PREFILL),
            make_worker(endpoint, cluster_keys, 3),
        ]
        assignments = [await worker.start(timeout_s=5) for worker in workers]
        assert [a.slot_ids for a in assignments] == [(2,), (0,), (1,), (3,)]
        assert [(a.role, a.group_index, a.dp_replica, a.tp_rank, a.pp_rank, a.world_size) for a in assignments] == [
            (Role.DECODE, 1, 0, 0, 0, 1),
            (Role.PREFILL, 0, 0, 0, 0, 2),
            (Role.PREFILL, 0, 0, 1, 0, 2),
            (Role.DECODE, 1, 1, 0, 0, 1),
        ]
        # w1 registered before its tp peer; it learns w2's address from the topology watch.
        assert assignments[1].peers == (Peer(0, "w1", "127.0.0.1:7001"), Peer(1))
        complete = await workers[1].wait_until_complete(timeout_s=3)
        assert complete.peers == (Peer(0, "w1", "127.0.0.1:7001"), Peer(1, "w2", "127.0.0.1:7002"))

        topology = await get_topology(cp.address)
        assert topology.occupants == ("w1", "w2", "w0", "w3")
        assert topology.leader.address == cp.address
        assert topology.lifecycle == LifecycleStatus()

        # A fifth worker has nowhere to go: it waits as a standby, then gives up.
        extra = make_worker(endpoint, cluster_keys, 4)
        with pytest.raises(TimeoutError, match="RESOURCE_EXHAUSTED: no replica has a free slot: 4 of 4 slots"):
            await extra.start(timeout_s=0.5)
        await extra.close()

        async with grpc.aio.insecure_channel(cp.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", SERVICE_NAME):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        for worker in workers:
            await worker.close()
        assert (await get_topology(cp.address)).occupants == (None,) * 4


async def test_watch_streams_a_lost_worker_and_its_replacement(etcd_server, cluster_keys):
    endpoint = etcd_server.endpoint
    async with running_control_plane(cp_config(endpoint, cluster_keys)) as cp:
        watcher = TopologyWatcher(cp.address)
        await watcher.wait_for(lambda t: t.occupants == (None,) * 4, 2)
        doomed = make_worker(endpoint, cluster_keys, 0, Role.DECODE)
        await doomed.start(timeout_s=5)
        await watcher.wait_for(lambda t: t.occupants[2] == "w0", 2)

        await doomed.close(deregister=False)  # crash: the lease just runs out
        start = time.monotonic()
        await watcher.wait_for(lambda t: t.occupants[2] is None and t.worker("w0") is None, TTL_S + 2)
        assert time.monotonic() - start < TTL_S + 2

        replacement = make_worker(endpoint, cluster_keys, 5, Role.DECODE)
        assert (await replacement.start(timeout_s=5)).slot_ids == (2,)
        await watcher.wait_for(lambda t: t.occupants[2] == "w5", 2)
        revisions = [t.revision for t in watcher.snapshots]
        assert revisions == sorted(set(revisions))
        await replacement.close()
        await watcher.close()


async def test_follower_redirects_writes_and_takes_over_on_resign(etcd_server, cluster_keys):
    endpoint = etcd_server.endpoint
    async with running_control_plane(cp_config(endpoint, cluster_keys, replica_id="cp-a")) as leader:
        follower_cm = running_control_plane(cp_config(endpoint, cluster_keys, replica_id="cp-b"), wait_for_leader=False)
        follower = await follower_cm.__aenter__()
        try:
            await asyncio.sleep(0.2)
            assert (leader.election.is_leader, follower.election.is_leader) == (True, False)
            async with grpc.aio.insecure_channel(follower.address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub(channel).Drain(control_plane_pb2.DrainRequest(worker_id="w0"))
                assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
                assert dict(info.value.trailing_metadata())[LEADER_ADDRESS_METADATA] == leader.address
            # A worker pointed at the follower is redirected to the leader.
            worker = make_worker(endpoint, cluster_keys, 0, control_plane=follower.address)
            assert (await worker.start(timeout_s=5)).slot_ids == (0,)
            assert (await get_topology(follower.address)).occupants[0] == "w0"

            start = time.monotonic()
            await leader.stop()
            await asyncio.wait_for(follower.election.wait_until_leader(), 2)
            assert time.monotonic() - start < 1.5
            await worker.close()
        finally:
            await follower_cm.__aexit__(None, None, None)


async def test_restarted_control_plane_picks_up_the_assignments(etcd_server, cluster_keys):
    endpoint = etcd_server.endpoint
    workers = [make_worker(endpoint, cluster_keys, i, Role.PREFILL) for i in range(2)]
    async with running_control_plane(cp_config(endpoint, cluster_keys, replica_id="first")):
        for worker in workers:
            await worker.start(timeout_s=5)
    # No control plane runs now; the workers' leases (their own) keep the slots.
    await asyncio.sleep(0.5)
    async with running_control_plane(cp_config(endpoint, cluster_keys, replica_id="second")) as cp:
        topology = await get_topology(cp.address)
        assert topology.occupants == ("w0", "w1", None, None)
        assert topology.leader.replica_id == "second"
        late = make_worker(endpoint, cluster_keys, 2)
        assert (await late.start(timeout_s=5)).slot_ids == (2,)
        for worker in [*workers, late]:
            await worker.close()
        # A replica with another spec refuses the cluster instead of misreading its slots.
        async with connect(endpoint) as client:
            other = ClusterStore(client, cluster_keys, parse_inference_shards("role=decode,tp=4"))
            with pytest.raises(SpecMismatchError, match="was created with --inference-shards"):
                await other.ensure_spec()


async def test_drain_and_lifecycle_reach_the_workers(etcd_server, cluster_keys):
    endpoint = etcd_server.endpoint
    async with running_control_plane(cp_config(endpoint, cluster_keys)) as cp:
        worker = make_worker(endpoint, cluster_keys, 0, num_gpu_ranks=2)
        assignment = await worker.start(timeout_s=5)
        assert (assignment.slot_ids, assignment.is_complete) == ((0, 1), True)
        await worker.drain()
        await worker.wait_for(lambda w: w.is_draining, 2)

        async with grpc.aio.insecure_channel(cp.address) as channel:
            cp_stub = stub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await cp_stub.Drain(control_plane_pb2.DrainRequest(worker_id="nobody"))
            assert (info.value.code(), info.value.details()) == (
                grpc.StatusCode.NOT_FOUND, "worker 'nobody' is not registered",
            )  # fmt: skip

            async def lifecycle(action, path=""):
                request = control_plane_pb2.LifecycleRequest(action=action_to_proto(action), checkpoint_path=path)
                return lifecycle_from_proto((await cp_stub.Lifecycle(request)).lifecycle)

            assert (await lifecycle(LifecycleAction.PAUSE)).state is LifecycleState.PAUSED
            assert (await lifecycle(LifecycleAction.SUSPEND)).state is LifecycleState.SUSPENDED
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await lifecycle(LifecycleAction.UNPAUSE)
            assert (info.value.code(), info.value.details()) == (
                grpc.StatusCode.FAILED_PRECONDITION, "cannot UNPAUSE while SUSPENDED: RESUME first",
            )  # fmt: skip
            reloaded = await lifecycle(LifecycleAction.RELOAD_WEIGHTS, "/ckpt/step-1")
            assert reloaded == LifecycleStatus(LifecycleState.SUSPENDED, 1, "/ckpt/step-1")
            await worker.wait_for(lambda w: w.topology.lifecycle == reloaded, 2)

        await worker.close()
        topology = await get_topology(cp.address)
        assert topology.workers == () and topology.occupants == (None,) * 4


async def test_worker_whose_lease_vanishes_reregisters_into_its_old_slot(etcd_server, cluster_keys):
    endpoint = etcd_server.endpoint
    async with running_control_plane(cp_config(endpoint, cluster_keys)) as cp:
        first = make_worker(endpoint, cluster_keys, 0, Role.DECODE)
        second = make_worker(endpoint, cluster_keys, 1, Role.DECODE)
        await first.start(timeout_s=5)
        assert (await second.start(timeout_s=5)).slot_ids == (3,)
        old_lease = second.assignment.lease_id
        async with connect(endpoint) as client:
            await client.revoke_lease(old_lease)  # as if etcd had lost it
        await second.wait_for(lambda w: w.assignment is not None and w.assignment.lease_id != old_lease, 5)
        assert second.assignment.slot_ids == (3,)
        assert (await get_topology(cp.address)).occupants == (None, None, "w0", "w1")
        for worker in (first, second):
            await worker.close()
