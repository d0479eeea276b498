"""A consistent snapshot of the cluster as stored in etcd, and how to read one from etcd's key-values.

Everything here is pure: `topology_from_kvs` takes the (key, value, lease)
triples of one etcd range read, so it can be tested without etcd.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

from splitserve.control_plane.assignment import Assignment, replica_peers
from splitserve.control_plane.keys import ClusterKeys
from splitserve.control_plane.lifecycle import LifecycleStatus
from splitserve.control_plane.records import LeaderRecord, WorkerRecord
from splitserve.control_plane.shard_spec import ShardSpec, Slot


@dataclass(frozen=True)
class WorkerInfo:
    """A registered worker as the topology sees it."""

    record: WorkerRecord
    lease_id: int
    slot_ids: tuple[int, ...]
    is_draining: bool = False

    @property
    def worker_id(self) -> str:
        return self.record.worker_id

    @property
    def address(self) -> str:
        return self.record.address


@dataclass(frozen=True)
class Topology:
    """Slots, who fills them, lifecycle and leader at one etcd revision."""

    revision: int
    """etcd revision of the read; strictly increases from one published snapshot to the next."""
    spec: ShardSpec
    lifecycle: LifecycleStatus
    occupants: tuple[str | None, ...]
    """Worker id filling each slot, indexed by slot id; None = free."""
    workers: tuple[WorkerInfo, ...]
    """Registered workers, sorted by worker id."""
    leader: LeaderRecord | None = None

    def __post_init__(self) -> None:
        if len(self.occupants) != self.spec.num_ranks:
            raise ValueError(f"occupants has {len(self.occupants)} entries for {self.spec.num_ranks} slots")
        ids = [worker.worker_id for worker in self.workers]
        if ids != sorted(set(ids)):
            raise ValueError(f"workers must be unique and sorted by id, got {ids!r}")

    @functools.cached_property
    def slots(self) -> tuple[Slot, ...]:
        return self.spec.slots()

    @functools.cached_property
    def _by_id(self) -> dict[str, WorkerInfo]:
        return {worker.worker_id: worker for worker in self.workers}

    def worker(self, worker_id: str) -> WorkerInfo | None:
        return self._by_id.get(worker_id)

    def occupied(self) -> dict[int, str]:
        """slot id -> worker id of every filled slot."""
        return {slot_id: worker_id for slot_id, worker_id in enumerate(self.occupants) if worker_id is not None}

    def free_slot_ids(self) -> tuple[int, ...]:
        return tuple(slot_id for slot_id, worker_id in enumerate(self.occupants) if worker_id is None)

    def assignment_for(self, worker_id: str) -> Assignment | None:
        """The worker's assignment with its replica's current peers; None if it holds no slot."""
        worker = self.worker(worker_id)
        if worker is None or not worker.slot_ids:
            return None
        slots = tuple(self.slots[slot_id] for slot_id in worker.slot_ids)
        addresses = {w.worker_id: w.address for w in self.workers}
        peers = replica_peers(self.slots, self.occupied(), addresses, slots[0].replica)
        return Assignment(worker_id, worker.lease_id, slots, peers, self.revision)


def topology_from_kvs(
    keys: ClusterKeys,
    spec: ShardSpec,
    revision: int,
    kvs: Iterable[tuple[bytes, bytes, int]],
) -> Topology:
    """Builds a snapshot from the (key, value, lease id) triples of one read of `keys.root`.

    A slot key whose worker key is missing counts as free: both live on the
    worker's lease and go together, so this only guards against hand edits.
    """
    records: dict[str, tuple[WorkerRecord, int]] = {}
    slot_owner: dict[int, str] = {}
    draining: set[str] = set()
    lifecycle = LifecycleStatus()
    leader = None
    for key, value, lease_id in kvs:
        if key == keys.lifecycle:
            lifecycle = LifecycleStatus.decode(value)
        elif key == keys.leader:
            leader = LeaderRecord.decode(value)
        elif key.startswith(keys.workers_prefix):
            record = WorkerRecord.decode(value)
            records[record.worker_id] = (record, lease_id)
        elif key.startswith(keys.slots_prefix):
            slot_id = keys.slot_id_of(key)
            if slot_id is not None and slot_id < spec.num_ranks:
                slot_owner[slot_id] = value.decode()
        elif key.startswith(keys.draining_prefix):
            draining.add(keys.worker_id_of(key) or "")
    occupants = tuple(
        owner if (owner := slot_owner.get(slot_id)) in records else None for slot_id in range(spec.num_ranks)
    )
    slot_ids: dict[str, list[int]] = {worker_id: [] for worker_id in records}
    for slot_id, owner in enumerate(occupants):
        if owner is not None:
            slot_ids[owner].append(slot_id)
    workers = tuple(
        WorkerInfo(record, lease_id, tuple(slot_ids[worker_id]), worker_id in draining)
        for worker_id, (record, lease_id) in sorted(records.items())
    )
    return Topology(revision, spec, lifecycle, occupants, workers, leader)
