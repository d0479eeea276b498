"""The leader-only operations: register a worker, mark one draining, change the lifecycle.

Each is read-decide-write: read the state from etcd, decide with the pure
policy (assignment.py, lifecycle.py), write with a fenced transaction
(cluster_store.py). One lock serialises them inside a replica, so two
registrations never race for a slot; the fencing token covers the rare
case of two replicas both believing they lead. A write whose comparison
fails is retried from a fresh read, after checking we still lead.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from splitserve.control_plane.assignment import Assignment, Peer, choose_slots, replica_peers
from splitserve.control_plane.cluster_store import ClusterStore
from splitserve.control_plane.election import LeaderElection
from splitserve.control_plane.errors import AlreadyRegisteredError, LeaseNotAliveError, NotLeaderError
from splitserve.control_plane.lifecycle import LifecycleAction, LifecycleStatus, apply_action
from splitserve.control_plane.records import WorkerRecord

_MAX_ATTEMPTS = 5


@dataclass(frozen=True)
class Registration:
    """A worker's Register call."""

    record: WorkerRecord
    lease_id: int
    """etcd lease the worker keeps alive; its assignment lives and dies with it."""
    preferred_slot_ids: tuple[int, ...] = ()
    """Slots it held before, taken again if still free."""

    def __post_init__(self) -> None:
        if not isinstance(self.lease_id, int) or self.lease_id <= 0:
            raise ValueError(f"lease_id must be a positive integer (an etcd lease), got {self.lease_id!r}")


class ClusterController:
    """Leader-only state changes of one control-plane replica (see the module docstring)."""

    def __init__(self, store: ClusterStore, election: LeaderElection) -> None:
        self._store = store
        self._election = election
        self._lock = asyncio.Lock()

    async def register(self, registration: Registration) -> Assignment:
        """Assigns slots to the worker; idempotent for a retry on the same lease.

        Raises NotLeaderError, AssignmentError, NoFreeSlotError, AlreadyRegisteredError,
        LeaseNotAliveError.
        """
        record = registration.record
        async with self._lock:
            for _ in range(_MAX_ATTEMPTS):
                fence = self._election.fence()
                topology = await self._store.read_topology()
                existing = topology.worker(record.worker_id)
                if existing is not None:
                    if existing.lease_id == registration.lease_id:
                        assignment = topology.assignment_for(record.worker_id)
                        if assignment is not None:
                            return assignment
                    raise AlreadyRegisteredError(
                        f"worker {record.worker_id!r} is already registered on lease {existing.lease_id:x}; "
                        "it frees the id when that lease ends"
                    )
                if not await self._store.is_lease_alive(registration.lease_id):
                    raise LeaseNotAliveError(
                        f"etcd lease {registration.lease_id:x} of worker {record.worker_id!r} is not alive"
                    )
                slots = choose_slots(
                    topology.slots,
                    topology.occupied(),
                    role=record.role,
                    num_gpu_ranks=record.num_gpu_ranks,
                    preferred_slot_ids=registration.preferred_slot_ids,
                )
                slot_ids = [slot.slot_id for slot in slots]
                revision = await self._store.commit_registration(record, registration.lease_id, slot_ids, fence)
                if revision is None:
                    await self._check_still_leader(fence)
                    continue
                occupied = topology.occupied() | dict.fromkeys(slot_ids, record.worker_id)
                addresses = {w.worker_id: w.address for w in topology.workers} | {record.worker_id: record.address}
                peers: tuple[Peer, ...] = replica_peers(topology.slots, occupied, addresses, slots[0].replica)
                return Assignment(record.worker_id, registration.lease_id, slots, peers, revision)
        raise RuntimeError(f"registering {record.worker_id!r} lost {_MAX_ATTEMPTS} races in a row")

    async def drain(self, worker_id: str) -> int:
        """Marks the worker draining; returns the etcd revision. Raises WorkerNotFoundError."""
        async with self._lock:
            for _ in range(_MAX_ATTEMPTS):
                fence = self._election.fence()
                revision = await self._store.mark_draining(worker_id, fence)
                if revision is not None:
                    return revision
                await self._check_still_leader(fence)
        raise RuntimeError(f"draining {worker_id!r} lost {_MAX_ATTEMPTS} races in a row")

    async def change_lifecycle(
        self, action: LifecycleAction, checkpoint_path: str | None = None
    ) -> tuple[LifecycleStatus, int]:
        """Applies the action cluster-wide; returns (new status, revision). Raises LifecycleError."""
        async with self._lock:
            for _ in range(_MAX_ATTEMPTS):
                fence = self._election.fence()
                current, mod_revision = await self._store.read_lifecycle()
                status = apply_action(current, action, checkpoint_path)
                if status == current:
                    return current, mod_revision
                revision = await self._store.write_lifecycle(status, mod_revision, fence)
                if revision is not None:
                    return status, revision
                await self._check_still_leader(fence)
        raise RuntimeError(f"{action.name} lost {_MAX_ATTEMPTS} races in a row")

    async def _check_still_leader(self, fence: int) -> None:
        leader, current_fence = await self._store.read_leader()
        if current_fence != fence:
            raise NotLeaderError(leader)
