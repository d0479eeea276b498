"""The ControlPlane gRPC service, and the one place protos and dataclasses are converted.

Clients (worker_registration.py, routers) use the `*_from_proto` functions
below so that nothing past this module handles protobuf messages.
Errors map to status codes as follows:

    NotLeaderError          FAILED_PRECONDITION + "splitserve-leader-address" trailing metadata
    LifecycleError          FAILED_PRECONDITION (no leader metadata)
    NoFreeSlotError         RESOURCE_EXHAUSTED  (wait for a slot to free up)
    AssignmentError, bad    INVALID_ARGUMENT
    request fields
    LeaseNotAliveError,     NOT_FOUND
    WorkerNotFoundError
    AlreadyRegisteredError  ALREADY_EXISTS      (the old lease has not ended yet)
    etcd unreachable        UNAVAILABLE
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

import aetcd
import grpc

from splitserve.control_plane.assignment import Assignment, AssignmentError, NoFreeSlotError, Peer
from splitserve.control_plane.cluster_store import ClusterStore
from splitserve.control_plane.controller import ClusterController, Registration
from splitserve.control_plane.errors import (
    AlreadyRegisteredError,
    LeaseNotAliveError,
    NotLeaderError,
    WorkerNotFoundError,
)
from splitserve.control_plane.lifecycle import (
    LifecycleAction,
    LifecycleError,
    LifecycleState,
    LifecycleStatus,
)
from splitserve.control_plane.records import LeaderRecord, WorkerRecord
from splitserve.control_plane.shard_spec import Role, Slot, parse_inference_shards
from splitserve.control_plane.topology import Topology, WorkerInfo
from splitserve.control_plane.topology_feed import TopologyFeed
from splitserve.proto.v1 import common_pb2, control_plane_pb2, control_plane_pb2_grpc

LEADER_ADDRESS_METADATA = "splitserve-leader-address"
WATCH_COALESCE_S = 0.2
"""A WatchTopology stream sends at most one snapshot per this many seconds after the first.

While a cluster comes up every registration is a new revision; each watcher (every
worker, every router) decodes each snapshot it is sent, O(n) per snapshot. 0.2 s keeps
a 128-worker burst to a handful of snapshots per watcher; a change still reaches the
watchers within 0.2 s of the previous one (a first snapshot goes out at once)."""

_ROLE_TO_PROTO = {None: common_pb2.ROLE_UNSPECIFIED, Role.PREFILL: common_pb2.ROLE_PREFILL, Role.DECODE: common_pb2.ROLE_DECODE}
_ROLE_FROM_PROTO = {v: k for k, v in _ROLE_TO_PROTO.items()}
_STATE_TO_PROTO = {state: control_plane_pb2.LifecycleState.Value(f"LIFECYCLE_STATE_{state.name}") for state in LifecycleState}
_STATE_FROM_PROTO = {v: k for k, v in _STATE_TO_PROTO.items()}
_ACTION_FROM_PROTO = {
    control_plane_pb2.LifecycleAction.Value(f"LIFECYCLE_ACTION_{action.name}"): action for action in LifecycleAction
}
_ACTION_TO_PROTO = {v: k for k, v in _ACTION_FROM_PROTO.items()}


def role_to_proto(role: Role | None) -> int:
    return _ROLE_TO_PROTO[role]


def role_from_proto(value: int) -> Role | None:
    if value not in _ROLE_FROM_PROTO:
        raise ValueError(f"unknown role {value!r}")
    return _ROLE_FROM_PROTO[value]


def slot_to_proto(slot: Slot) -> control_plane_pb2.Slot:
    return control_plane_pb2.Slot(
        slot_id=slot.slot_id, group_index=slot.group_index, role=_ROLE_TO_PROTO[slot.role],
        dp_replica=slot.dp_replica, tp_rank=slot.tp_rank, pp_rank=slot.pp_rank, tp=slot.tp, pp=slot.pp,
    )  # fmt: skip


def slot_from_proto(message: control_plane_pb2.Slot) -> Slot:
    return Slot(
        message.slot_id, message.group_index, role_from_proto(message.role), message.dp_replica,
        message.tp_rank, message.pp_rank, message.tp, message.pp,
    )  # fmt: skip


def assignment_to_proto(assignment: Assignment) -> control_plane_pb2.Assignment:
    return control_plane_pb2.Assignment(
        worker_id=assignment.worker_id,
        lease_id=assignment.lease_id,
        slots=[slot_to_proto(slot) for slot in assignment.slots],
        peers=[control_plane_pb2.Peer(rank=p.rank, worker_id=p.worker_id or "", address=p.address or "") for p in assignment.peers],
        revision=assignment.revision,
    )


def assignment_from_proto(message: control_plane_pb2.Assignment) -> Assignment:
    peers = tuple(Peer(p.rank, p.worker_id or None, p.address or None) for p in message.peers)
    slots = tuple(slot_from_proto(slot) for slot in message.slots)
    return Assignment(message.worker_id, message.lease_id, slots, peers, message.revision)


def lifecycle_to_proto(status: LifecycleStatus) -> control_plane_pb2.LifecycleStatus:
    return control_plane_pb2.LifecycleStatus(
        state=_STATE_TO_PROTO[status.state],
        weights_version=status.weights_version,
        checkpoint_path=status.checkpoint_path or "",
    )


def lifecycle_from_proto(message: control_plane_pb2.LifecycleStatus) -> LifecycleStatus:
    return LifecycleStatus(_STATE_FROM_PROTO[message.state], message.weights_version, message.checkpoint_path or None)


def topology_to_proto(topology: Topology) -> control_plane_pb2.Topology:
    return control_plane_pb2.Topology(
        revision=topology.revision,
        inference_shards=topology.spec.to_text(),
        lifecycle=lifecycle_to_proto(topology.lifecycle),
        slots=[
            control_plane_pb2.SlotStatus(slot=slot_to_proto(slot), worker_id=topology.occupants[slot.slot_id] or "")
            for slot in topology.slots
        ],
        workers=[
            control_plane_pb2.WorkerStatus(
                worker_id=w.worker_id, address=w.address, role=_ROLE_TO_PROTO[w.record.role],
                num_gpu_ranks=w.record.num_gpu_ranks, slot_ids=w.slot_ids, is_draining=w.is_draining,
                lease_id=w.lease_id, kv_events_endpoint=w.record.kv_events_endpoint or "",
                kv_block_size=w.record.kv_block_size or 0,
            )  # fmt: skip
            for w in topology.workers
        ],
        leader_id=topology.leader.replica_id if topology.leader else "",
        leader_address=topology.leader.address if topology.leader else "",
    )


def _worker_info_from_proto(w: control_plane_pb2.WorkerStatus) -> WorkerInfo:
    record = WorkerRecord(
        w.worker_id, w.address, role_from_proto(w.role), w.num_gpu_ranks, w.kv_events_endpoint or None,
        w.kv_block_size or None,
    )  # fmt: skip
    return WorkerInfo(record, w.lease_id, tuple(w.slot_ids), w.is_draining)


@functools.lru_cache(maxsize=4096)
def _worker_info_from_bytes(data: bytes) -> WorkerInfo:
    return _worker_info_from_proto(control_plane_pb2.WorkerStatus.FromString(data))


def topology_from_proto(message: control_plane_pb2.Topology) -> Topology:
    """Decodes a snapshot; a worker entry seen before (same bytes) reuses its frozen WorkerInfo,
    so a watcher pays the record checks only for workers that changed."""
    workers = tuple(_worker_info_from_bytes(w.SerializeToString(deterministic=True)) for w in message.workers)
    leader = LeaderRecord(message.leader_id, message.leader_address) if message.leader_id else None
    return Topology(
        revision=message.revision,
        spec=parse_inference_shards(message.inference_shards),
        lifecycle=lifecycle_from_proto(message.lifecycle),
        occupants=tuple(s.worker_id or None for s in message.slots),
        workers=workers,
        leader=leader,
    )


def registration_from_proto(message: control_plane_pb2.RegisterRequest) -> Registration:
    record = WorkerRecord(
        message.worker_id, message.address, role_from_proto(message.role), message.num_gpu_ranks or 1,
        message.kv_events_endpoint or None, message.kv_block_size or None,
    )
    return Registration(record, message.lease_id, tuple(message.preferred_slot_ids))


async def _abort(context: grpc.aio.ServicerContext, error: Exception) -> None:
    """Ends the call with the status code of `error` (table in the module docstring)."""
    if isinstance(error, NotLeaderError):
        metadata = ((LEADER_ADDRESS_METADATA, error.leader.address),) if error.leader else ()
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error), trailing_metadata=metadata)
    codes = [
        (LifecycleError, grpc.StatusCode.FAILED_PRECONDITION),
        (NoFreeSlotError, grpc.StatusCode.RESOURCE_EXHAUSTED),
        ((LeaseNotAliveError, WorkerNotFoundError), grpc.StatusCode.NOT_FOUND),
        (AlreadyRegisteredError, grpc.StatusCode.ALREADY_EXISTS),
        ((AssignmentError, ValueError), grpc.StatusCode.INVALID_ARGUMENT),
        (aetcd.ClientError, grpc.StatusCode.UNAVAILABLE),
    ]
    for kind, code in codes:
        if isinstance(error, kind):
            prefix = "etcd unavailable: " if code is grpc.StatusCode.UNAVAILABLE else ""
            await context.abort(code, f"{prefix}{error}")
    raise error


_HANDLED = (NotLeaderError, LifecycleError, NoFreeSlotError, LeaseNotAliveError, WorkerNotFoundError,
            AlreadyRegisteredError, ValueError, aetcd.ClientError)  # fmt: skip


class ControlPlaneService(control_plane_pb2_grpc.ControlPlaneServicer):
    """gRPC face of one replica: reads from etcd / the feed, writes through the controller."""

    def __init__(self, controller: ClusterController, store: ClusterStore, feed: TopologyFeed) -> None:
        self._controller = controller
        self._store = store
        self._feed = feed
        # The feed's latest snapshot as a proto, converted once for all WatchTopology streams.
        self._latest_proto: tuple[Topology | None, control_plane_pb2.Topology | None] = (None, None)

    def _to_proto(self, topology: Topology) -> control_plane_pb2.Topology:
        cached, message = self._latest_proto
        if cached is not topology:
            message = topology_to_proto(topology)
            self._latest_proto = (topology, message)
        return message

    async def Register(self, request, context):
        try:
            assignment = await self._controller.register(registration_from_proto(request))
        except _HANDLED as e:
            await _abort(context, e)
        return assignment_to_proto(assignment)

    async def GetTopology(self, request, context):
        try:
            # A fresh read rather than the feed: a caller sees its own just-made change.
            topology = await self._store.read_topology()
        except _HANDLED as e:
            await _abort(context, e)
        return topology_to_proto(topology)

    async def WatchTopology(self, request, context) -> AsyncIterator[control_plane_pb2.Topology]:
        revision = request.after_revision
        while (topology := await self._feed.next_after(revision)) is not None:
            if revision:
                # Let a burst (a cluster coming up) settle into one snapshot instead of one per change:
                # n workers each watching n registrations is O(n^2) messages otherwise.
                await asyncio.sleep(WATCH_COALESCE_S)
                topology = self._feed.latest or topology
            yield self._to_proto(topology)
            revision = topology.revision

    async def Drain(self, request, context):
        try:
            revision = await self._controller.drain(request.worker_id)
        except _HANDLED as e:
            await _abort(context, e)
        return control_plane_pb2.DrainResponse(revision=revision)

    async def Lifecycle(self, request, context):
        try:
            if request.action not in _ACTION_FROM_PROTO:
                raise ValueError(f"unknown lifecycle action {request.action!r}")
            action = _ACTION_FROM_PROTO[request.action]
            status, revision = await self._controller.change_lifecycle(action, request.checkpoint_path or None)
        except _HANDLED as e:
            await _abort(context, e)
        return control_plane_pb2.LifecycleResponse(lifecycle=lifecycle_to_proto(status), revision=revision)


def action_to_proto(action: LifecycleAction) -> int:
    return _ACTION_TO_PROTO[action]
