"""Which workers a router can send requests to, read from a control-plane `Topology`.

A shard (one dp replica of a group) is served by the process holding its
rank 0, and only once every rank of the replica is filled (before that its
process group cannot form). That process is the routable "worker": its
gRPC address takes Prefill/Decode calls, its ZMQ endpoint publishes the
shard's KV events, and its role is the slot's role.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from splitserve.control_plane.shard_spec import Role, Slot
from splitserve.control_plane.topology import Topology


@dataclass(frozen=True)
class WorkerEndpoint:
    """A routable worker and how to reach it."""

    worker_id: str
    address: str
    """gRPC host:port of its PrefillWorker or DecodeWorker service."""
    role: Role
    kv_events_endpoint: str | None = None
    """ZMQ PUB endpoint of its KV events; None = it publishes none."""
    kv_block_size: int | None = None
    """Tokens per KV block it advertised; None = not advertised."""
    lease_id: int = 0
    """etcd lease of its registration: a new one means a new process (restart its KV-event stream)."""
    is_draining: bool = False
    """Finishing its requests before leaving: no new ones are routed to it."""
    tp: int = 1
    """Tensor-parallel size of its group (a prefill worker packs a handoff's head slices for it)."""

    def __post_init__(self) -> None:
        if not isinstance(self.worker_id, str) or not self.worker_id:
            raise ValueError(f"worker_id must be a non-empty string, got {self.worker_id!r}")
        if not isinstance(self.role, Role):
            raise ValueError(f"role must be a Role, got {self.role!r}")
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"address must be host:port, got {self.address!r}")

    @property
    def event_stream_key(self) -> tuple[str | None, int]:
        """Changes exactly when the worker's KV-event stream restarts (new endpoint or new process)."""
        return (self.kv_events_endpoint, self.lease_id)


def routable_workers(topology: Topology) -> dict[str, WorkerEndpoint]:
    """worker id -> endpoint of the rank-0 process of every fully filled replica."""
    replicas: dict[tuple[int, int], list[Slot]] = defaultdict(list)
    for slot in topology.slots:
        replicas[slot.replica].append(slot)
    routable: dict[str, WorkerEndpoint] = {}
    for slots in replicas.values():
        if any(topology.occupants[slot.slot_id] is None for slot in slots):
            continue
        front = next(slot for slot in slots if slot.rank == 0)
        worker = topology.worker(topology.occupants[front.slot_id])
        if worker is None:
            continue
        record = worker.record
        routable[worker.worker_id] = WorkerEndpoint(
            worker_id=worker.worker_id,
            address=worker.address,
            role=front.role,
            kv_events_endpoint=record.kv_events_endpoint,
            kv_block_size=record.kv_block_size,
            lease_id=worker.lease_id,
            is_draining=worker.is_draining,
            tp=front.tp,
        )
    return routable
