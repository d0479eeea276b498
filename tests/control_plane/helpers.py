"""Shared helpers of the control-plane tests (in-process replicas, workers, waiting)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.control_plane.keys import ClusterKeys
from splitserve.control_plane.server import ControlPlaneConfig, ControlPlaneServer
from splitserve.control_plane.service import topology_from_proto
from splitserve.control_plane.shard_spec import Role
from splitserve.control_plane.topology import Topology
from splitserve.control_plane.worker_registration import WorkerRegistration
from splitserve.proto.v1 import control_plane_pb2, control_plane_pb2_grpc

SPEC = "tp=2,role=prefill+tp=1,dp=2,role=decode"
TTL_S = 2


def cp_config(etcd_endpoint: str, keys: ClusterKeys, **overrides) -> ControlPlaneConfig:
    fields = dict(
        inference_shards=SPEC, etcd=etcd_endpoint, listen="127.0.0.1:0", cluster=keys.cluster,
        key_prefix=keys.prefix, lease_ttl_s=TTL_S, grace_period_s=0.5,
    )  # fmt: skip
    return ControlPlaneConfig(**(fields | overrides))


@contextlib.asynccontextmanager
async def running_control_plane(config: ControlPlaneConfig, *, wait_for_leader: bool = True):
    server = ControlPlaneServer(config)
    await server.start()
    try:
        if wait_for_leader:
            await asyncio.wait_for(server.election.wait_until_leader(), 5)
        yield server
    finally:
        await server.stop()


def make_worker(
    etcd_endpoint: str, keys: ClusterKeys, number: int, role: Role | None = None, **kwargs
) -> WorkerRegistration:
    return WorkerRegistration(
        etcd=etcd_endpoint, address=f"127.0.0.1:{7000 + number}", role=role, worker_id=f"w{number}",
        keys=keys, lease_ttl_s=TTL_S, **kwargs,
    )  # fmt: skip


def stub(channel: grpc.aio.Channel) -> control_plane_pb2_grpc.ControlPlaneStub:
    return control_plane_pb2_grpc.ControlPlaneStub(channel)


async def wait_serving(address: str, timeout_s: float) -> None:
    """Returns once the gRPC health service at `address` answers SERVING."""
    request = health_pb2.HealthCheckRequest(service="")
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout_s, wait_for_ready=True)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def get_topology(address: str) -> Topology:
    async with grpc.aio.insecure_channel(address) as channel:
        return topology_from_proto(await stub(channel).GetTopology(control_plane_pb2.GetTopologyRequest()))


class TopologyWatcher:
    """Collects the snapshots of one WatchTopology stream in the background."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.aio.insecure_channel(address)
        self.snapshots: list[Topology] = []
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for message in stub(self._channel).WatchTopology(control_plane_pb2.WatchTopologyRequest()):
            self.snapshots.append(topology_from_proto(message))
            self._changed.set()

    async def wait_for(self, predicate, timeout_s: float) -> Topology:
        """The latest snapshot if it satisfies `predicate`, else the first later one that does."""
        deadline = time.monotonic() + timeout_s
        seen = max(len(self.snapshots) - 1, 0)
        while True:
            for snapshot in self.snapshots[seen:]:
                if predicate(snapshot):
                    return snapshot
            seen = len(self.snapshots)
            self._changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"no matching topology within {timeout_s} s; last: {self.snapshots[-1:]}")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._channel.close()
