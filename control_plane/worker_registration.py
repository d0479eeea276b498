"""A worker's membership in the cluster: etcd lease + keepalive, Register, and the topology it follows.

    registration = WorkerRegistration(etcd="127.0.0.1:2379", address="127.0.0.1:7001", role=Role.PREFILL)
    assignment = await registration.start()          # waits for a free slot
    assignment = await registration.wait_until_complete()   # every rank of the replica filled
    ...                                              # serve; follow registration.topology
    await registration.close()                       # deregister: the slot frees at once

The worker holds its own etcd lease (registry.LeaseKeeper) and the control
plane attaches the assignment to it, so a crashed worker's slot frees after
one TTL even if no control plane is running. The leader's address is read
from etcd's leader key (or given). If etcd reports the lease gone (say etcd
lost its data), the worker re-registers on a new lease and asks for its old
slots back; `assignment` is None in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable

import aetcd
import grpc

from splitserve import grpc_security
from splitserve.control_plane.assignment import Assignment
from splitserve.control_plane.cluster_store import read_leader
from splitserve.control_plane.etcd_client import connect
from splitserve.control_plane.keys import ClusterKeys
from splitserve.control_plane.records import WorkerRecord
from splitserve.control_plane.registry import DEFAULT_LEASE_TTL_S, LeaseKeeper
from splitserve.control_plane.service import (
    LEADER_ADDRESS_METADATA,
    assignment_from_proto,
    role_to_proto,
    topology_from_proto,
)
from splitserve.control_plane.shard_spec import Role
from splitserve.control_plane.topology import Topology
from splitserve.proto.v1 import control_plane_pb2, control_plane_pb2_grpc

log = logging.getLogger(__name__)

# Answers that mean "try again later" rather than "this request is wrong".
_RETRY = {
    grpc.StatusCode.UNAVAILABLE,  # control plane or etcd down
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,  # no free slot yet: wait as a standby
    grpc.StatusCode.ALREADY_EXISTS,  # our previous registration's lease has not ended yet
    grpc.StatusCode.FAILED_PRECONDITION,  # a follower, or no leader elected yet
}


START_GRACE_S = 5.0
"""How long past its timeout `start` lets an in-flight call finish before cancelling it."""


class RegistrationError(RuntimeError):
    """The control plane rejected the registration for good (e.g. num_gpu_ranks too large)."""


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class WorkerRegistration:
    """Registers one worker process and keeps its assignment and the topology current.

    All methods run on one event loop; `assignment` and `topology` change
    only between awaits.
    """

    def __init__(
        self,
        *,
        etcd: str,
        address: str,
        role: Role | None = None,
        num_gpu_ranks: int = 1,
        worker_id: str | None = None,
        keys: ClusterKeys | None = None,
        lease_ttl_s: int = DEFAULT_LEASE_TTL_S,
        control_plane: str | None = None,
        kv_events_endpoint: str | None = None,
        kv_block_size: int | None = None,
    ) -> None:
        """`kv_events_endpoint` / `kv_block_size` are advertised in the topology for routers:
        the worker's KVEventPublisher.endpoint and its KV block size."""
        self.record = WorkerRecord(
            worker_id or default_worker_id(), address, role, num_gpu_ranks, kv_events_endpoint, kv_block_size
        )
        self._keys = keys or ClusterKeys()
        self._client = connect(etcd)
        self._lease_ttl_s = lease_ttl_s
        self._control_plane = control_plane
        self._keeper: LeaseKeeper | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._changed = asyncio.Condition()
        self.assignment: Assignment | None = None
        """Current slots and peers; None while (re-)registering."""
        self.topology: Topology | None = None
        """Latest cluster snapshot from WatchTopology."""

    @property
    def worker_id(self) -> str:
        return self.record.worker_id

    @property
    def is_draining(self) -> bool:
        worker = self.topology.worker(self.worker_id) if self.topology else None
        return worker is not None and worker.is_draining

    async def start(self, timeout_s: float | None = 60.0) -> Assignment:
        """Takes a lease, registers (waiting for a free slot up to `timeout_s`), follows the topology."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        # _register gives up at the deadline between its retries; the outer bound also ends a call
        # stuck on a starved event loop (a hang is worse than a clear error).
        bound = asyncio.timeout(None if timeout_s is None else timeout_s + START_GRACE_S)
        try:
            async with bound:
                await self._new_lease()
                assignment = await self._register((), deadline)
        except TimeoutError as e:
            if not bound.expired():
                raise
            raise TimeoutError(f"worker {self.worker_id!r}: registration did not finish within {timeout_s} s") from e
        await self._set_assignment(assignment)
        self._tasks = [
            asyncio.create_task(self._follow_topology(), name=f"{self.worker_id}-topology"),
            asyncio.create_task(self._reregister_on_loss(), name=f"{self.worker_id}-lease"),
        ]
        return self.assignment

    async def __aenter__(self) -> WorkerRegistration:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def wait_for(self, predicate: Callable[[WorkerRegistration], bool], timeout_s: float | None = None) -> None:
        """Waits until `predicate(self)` holds (checked after every assignment or topology change)."""
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: predicate(self)), timeout_s)

    async def wait_until_complete(self, timeout_s: float | None = None) -> Assignment:
        """The assignment once every rank of the replica is filled (the process group can form)."""
        await self.wait_for(lambda r: r.assignment is not None and r.assignment.is_complete, timeout_s)
        return self.assignment

    async def drain(self) -> None:
        """Asks the control plane to mark this worker draining (e.g. from a preStop hook)."""
        request = control_plane_pb2.DrainRequest(worker_id=self.worker_id)
        await self._call_leader(lambda stub: stub.Drain(request, timeout=5.0), deadline=time.monotonic() + 30)

    async def close(self, *, deregister: bool = True) -> None:
        """Stops following; `deregister` revokes the lease so the slot frees now, not after a TTL."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._keeper is not None:
            await self._keeper.close(revoke=deregister)
        for channel in self._channels.values():
            await channel.close()
        await self._client.close()

    async def _new_lease(self) -> None:
        """Replaces the keeper with a started one (raises aetcd.ClientError while etcd is down)."""
        keeper = LeaseKeeper(self._client, self._lease_ttl_s, name=f"{self.worker_id}-lease")
        await keeper.start()
        if self._keeper is not None:
            await self._keeper.close(revoke=False)
        self._keeper = keeper

    async def _set_assignment(self, assignment: Assignment | None, topology: Topology | None = None) -> None:
        async with self._changed:
            self.assignment = assignment
            if topology is not None:
                self.topology = topology
            self._changed.notify_all()

    def _stub(self, address: str) -> control_plane_pb2_grpc.ControlPlaneStub:
        if address not in self._channels:
            self._channels[address] = grpc_security.aio_channel(address)
        return control_plane_pb2_grpc.ControlPlaneStub(self._channels[address])

    async def _addresses(self) -> list[str]:
        """Where to reach the control plane: the given address, then the leader named in etcd."""
        addresses = [self._control_plane] if self._control_plane else []
        with contextlib.suppress(aetcd.ClientError, TimeoutError):  # etcd down: use what we have
            leader, _ = await read_leader(self._client, self._keys)
            if leader is not None and leader.address not in addresses:
                addresses.append(leader.address)
        return addresses

    async def _call_leader(self, call: Callable, deadline: float | None):
        """Runs `call(stub)` against the leader, following redirects and retrying transient errors."""
        delay, last_error = 0.05, "no control-plane address known yet (no leader in etcd)"
        while True:
            addresses = await self._addresses()
            while addresses:
                address = addresses.pop(0)
                try:
                    return await call(self._stub(address))
                except grpc.aio.AioRpcError as e:
                    if e.code() not in _RETRY:
                        raise RegistrationError(f"{e.code().name}: {e.details()}") from e
                    last_error = f"{address}: {e.code().name}: {e.details()}"
                    redirect = dict(e.trailing_metadata() or ()).get(LEADER_ADDRESS_METADATA)
                    if redirect and redirect not in addresses and redirect != address:
                        addresses.insert(0, redirect)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"worker {self.worker_id!r}: control plane call timed out; last error: {last_error}")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def _register(self, preferred_slot_ids: tuple[int, ...], deadline: float | None) -> Assignment:
        def request() -> control_plane_pb2.RegisterRequest:
            return control_plane_pb2.RegisterRequest(
                worker_id=self.worker_id, address=self.record.address, role=role_to_proto(self.record.role),
                num_gpu_ranks=self.record.num_gpu_ranks, lease_id=self._keeper.lease_id,
                preferred_slot_ids=preferred_slot_ids, kv_events_endpoint=self.record.kv_events_endpoint or "",
                kv_block_size=self.record.kv_block_size or 0,
            )  # fmt: skip

        async def call(stub: control_plane_pb2_grpc.ControlPlaneStub) -> control_plane_pb2.Assignment:
            try:
                return await stub.Register(request(), timeout=5.0)
            except grpc.aio.AioRpcError as e:
                if e.code() is not grpc.StatusCode.NOT_FOUND:
                    raise
            await self._new_lease()  # our lease ended before the control plane saw it
            return await stub.Register(request(), timeout=5.0)

        assignment = assignment_from_proto(await self._call_leader(call, deadline))
        log.info("worker %s assigned slots %s", self.worker_id, assignment.slot_ids)
        return assignment

    async def _follow_topology(self) -> None:
        revision = 0
        while True:
            for address in await self._addresses():
                try:
                    request = control_plane_pb2.WatchTopologyRequest(after_revision=revision)
                    async for message in self._stub(address).WatchTopology(request):
                        topology = topology_from_proto(message)
                        revision = topology.revision
                        current = topology.assignment_for(self.worker_id)
                        if current is not None and current.lease_id != self._keeper.lease_id:
                            current = None  # a stale registration of ours, about to expire
                        await self._set_assignment(current or self.assignment, topology)
                except grpc.aio.AioRpcError as e:
                    log.debug("topology watch on %s ended: %s", address, e.code().name)
            await asyncio.sleep(0.2)

    async def _reregister_on_loss(self) -> None:
        while True:
            await self._keeper.lost.wait()
            previous = self.assignment.slot_ids if self.assignment else ()
            log.warning("worker %s lost its lease; re-registering (previous slots %s)", self.worker_id, previous)
            await self._set_assignment(None)
            while True:
                try:
                    await self._new_lease()
                    break
                except (aetcd.ClientError, TimeoutError) as e:  # etcd still unreachable
                    log.debug("new lease failed: %s", e)
                    await asyncio.sleep(0.5)
            await self._set_assignment(await self._register(previous, deadline=None))

