"""The router's topology: routable workers, block-size checks, and a real control plane + etcd."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from splitserve.control_plane.lifecycle import LifecycleStatus
from splitserve.control_plane.records import WorkerRecord
from splitserve.control_plane.service import topology_from_proto, topology_to_proto
from splitserve.control_plane.shard_spec import Role, parse_inference_shards
from splitserve.control_plane.topology import Topology, WorkerInfo
from splitserve.control_plane.worker_registration import WorkerRegistration
from splitserve.engine.block_hash import hash_blocks
from splitserve.engine.block_pool import BlockPool
from splitserve.engine.kv_events import KVEventPublisher
from splitserve.proto.v1 import common_pb2, router_pb2, router_pb2_grpc
from splitserve.router.cluster_view import BlockSizeMismatchError, check_block_sizes
from splitserve.router.config import RouterConfig
from splitserve.router.server import RouterServer
from splitserve.router.topology_watcher import TopologyWatcher as RouterTopologyWatcher
from splitserve.router.workers import WorkerEndpoint, routable_workers
from tests.control_plane.helpers import TopologyWatcher, cp_config, running_control_plane
from tests.router.router_doubles import DecodeDouble, PrefillDouble, serving

SPEC = "tp=2,role=prefill+tp=1,dp=2,role=decode"


def _topology(occupants, records) -> Topology:
    workers = tuple(
        WorkerInfo(record, lease_id=7, slot_ids=tuple(i for i, o in enumerate(occupants) if o == record.worker_id))
        for record in sorted(records, key=lambda r: r.worker_id)
    )
    return Topology(1, parse_inference_shards(SPEC), LifecycleStatus(), tuple(occupants), workers)


def test_routable_workers_are_rank_zero_of_complete_replicas():
    records = [
        WorkerRecord("pa", "127.0.0.1:1", Role.PREFILL, kv_events_endpoint="tcp://127.0.0.1:9", kv_block_size=16),
        WorkerRecord("pb", "127.0.0.1:2", Role.PREFILL),
        WorkerRecord("d0", "127.0.0.1:3"),
    ]
    topology = _topology(("pa", "pb", "d0", None), records)
    assert routable_workers(topology) == {
        "pa": WorkerEndpoint("pa", "127.0.0.1:1", Role.PREFILL, "tcp://127.0.0.1:9", 16, lease_id=7, tp=2),
        "d0": WorkerEndpoint("d0", "127.0.0.1:3", Role.DECODE, lease_id=7),  # role from the slot
    }
    # The tp=2 replica misses its rank 1: its rank 0 cannot serve yet.
    assert set(routable_workers(_topology(("pa", None, "d0", None), records[::2]))) == {"d0"}
    # The new record fields survive the control plane's proto round trip.
    assert topology_from_proto(topology_to_proto(topology)) == topology


def test_block_size_comes_from_the_router_or_the_workers_and_must_agree():
    def worker(worker_id: str, size: int | None) -> WorkerEndpoint:
        return WorkerEndpoint(worker_id, "127.0.0.1:1", Role.DECODE, kv_block_size=size)

    assert check_block_sizes({"a": worker("a", 16), "b": worker("b", None)}, None) == 16
    assert check_block_sizes({"a": worker("a", 16)}, 16) == 16
    assert check_block_sizes({}, 32) == 32
    with pytest.raises(BlockSizeMismatchError, match="worker 'a' uses KV block size 16 but the router's --block-size is 8"):
        check_block_sizes({"a": worker("a", 16)}, 8)
    with pytest.raises(BlockSizeMismatchError, match="worker 'b' uses KV block size 32 but worker 'a''s is 16"):
        check_block_sizes({"a": worker("a", 16), "b": worker("b", 32)}, None)


async def test_router_follows_the_control_plane_and_routes_by_kv_events(router_etcd, router_keys):
    prefill, decode = PrefillDouble("p0"), DecodeDouble("d0")
    pool, publisher = BlockPool(num_blocks=8), KVEventPublisher("p0", block_size=4)
    prefill.block_set_source = lambda: publisher.block_set(pool.cached_hashes())
    config = cp_config(router_etcd.endpoint, router_keys, inference_shards="role=prefill+role=decode")
    registrations: list[WorkerRegistration] = []
    async with serving(prefill, decode) as endpoints, running_control_plane(config) as control_plane:
        try:
            for worker_id, role, kv_endpoint in (("p0", Role.PREFILL, publisher.endpoint), ("d0", Role.DECODE, None)):
                registration = WorkerRegistration(
                    etcd=router_etcd.endpoint, address=endpoints[worker_id].address, role=role, worker_id=worker_id,
                    keys=router_keys, lease_ttl_s=2, kv_events_endpoint=kv_endpoint, kv_block_size=4,
                )  # fmt: skip
                await registration.start()
                registrations.append(registration)

            # Start routers only once the control plane publishes both workers.
            watcher = TopologyWatcher(control_plane.address)
            await watcher.wait_for(lambda t: len(routable_workers(t)) == 2, timeout_s=10)
            await watcher.close()
            mismatched = RouterServer(RouterConfig(control_planes=(control_plane.address,), block_size=8))
            with pytest.raises(BlockSizeMismatchError, match="uses KV block size 4 but the router's --block-size is 8"):
                await mismatched.start()
            await mismatched.stop()

            server = RouterServer(RouterConfig(control_planes=(control_plane.address,)))
            await server.start()
            try:
                assert server.view.block_size == 4
                assert server.view.workers["p0"].kv_events_endpoint == publisher.endpoint
                # The prefill worker caches the prompt's first two blocks: the router learns it from events.
                prompt = list(range(100, 112))
                block_ids = pool.allocate(2)
                hashes = hash_blocks(prompt, 4)
                pool.register(block_ids[0], hashes[0], None)
                pool.register(block_ids[1], hashes[1], hashes[0])
                pool.free(block_ids[::-1])
                publisher.publish(pool.drain_events())
                await asyncio.wait_for(server.subscriber.wait_synced("p0"), 5)
                await _until(lambda: server.view.index.lookup(hashes) == {"p0": 2})
                async with grpc.aio.insecure_channel(server.address) as channel:
                    params = common_pb2.SamplingParams(num_tokens_to_generate=2)
                    message = router_pb2.GenerateRequest(request_id="r", token_ids=prompt, sampling_params=params)
                    chunks = [c async for c in router_pb2_grpc.RouterStub(channel).Generate(message)]
                assert chunks[-1].routing.predicted_cached_tokens == 8
                assert chunks[-1].routing.prefill_worker_id == "p0"

                # d0 publishes no events: it is indexed from what it was routed (3 full blocks).
                assert server.view.index.lookup(hashes) == {"p0": 2, "d0": 3}
                # The prefill worker leaves: its blocks go.
                await registrations.pop(0).close()
                await _until(lambda: "p0" not in server.view.workers)
                assert server.view.index.lookup(hashes) == {"d0": 3}
            finally:
                await server.stop()
        finally:
            for registration in registrations:
                await registration.close()
            publisher.close()


async def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_topology_watch_moves_to_another_replica_when_one_stops(router_etcd, router_keys):
    config = cp_config(router_etcd.endpoint, router_keys, inference_shards="role=prefill+role=decode")
    seen: list[Topology] = []
    async with running_control_plane(config) as first, running_control_plane(config, wait_for_leader=False) as second:
        watcher = RouterTopologyWatcher([first.address, second.address], seen.append, retry_delay_s=0.05)
        watcher.start()
        try:
            await watcher.wait_first(5)
            await first.stop()  # its WatchTopology streams end; the watcher resumes on the second replica
            registration = WorkerRegistration(
                etcd=router_etcd.endpoint, address="127.0.0.1:7001", role=Role.DECODE, worker_id="d0",
                keys=router_keys, lease_ttl_s=2, control_plane=second.address,
            )  # fmt: skip
            await registration.start(timeout_s=10)
            try:
                await _until(lambda: "d0" in routable_workers(watcher.latest))
            finally:
                await registration.close()
            revisions = [t.revision for t in seen]
            assert revisions == sorted(set(revisions))  # no snapshot replayed after the reconnect
        finally:
            await watcher.close()
