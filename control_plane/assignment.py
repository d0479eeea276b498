"""Which slots a registering worker gets, and what it learns about its replica.

Pure functions over the current occupancy (slot id -> worker id); the etcd
side lives in cluster_store.py. Policy:

* A worker driving ``n`` GPU ranks gets ``n`` consecutive ranks of one dp
  replica, starting at a multiple of ``n`` (a 2-GPU process of a tp=4
  replica takes ranks 0-1 or 2-3, never 1-2).
* Slots fill in slot-id order (first fit), so a cluster comes up group by
  group and a lost worker's slot is the first one re-filled.
* A worker that held slots before (e.g. it lost its lease during an etcd
  outage) asks for them back with ``preferred_slot_ids`` and gets them if
  they are still free.
* A worker that names a role only gets slots of that role.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import groupby

from splitserve.control_plane.shard_spec import Role, Slot


class AssignmentError(ValueError):
    """The request can never be satisfied by this spec (not a matter of waiting)."""


class NoFreeSlotError(LookupError):
    """Every matching slot is taken right now; a later attempt may succeed."""


@dataclass(frozen=True)
class Peer:
    """One rank of a dp replica and the worker filling it."""

    rank: int
    worker_id: str | None = None
    """None while the slot is free."""
    address: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"rank must be a non-negative integer, got {self.rank!r}")
        if (self.worker_id is None) != (self.address is None):
            raise ValueError(f"worker_id and address are set together, got {self.worker_id!r}, {self.address!r}")


@dataclass(frozen=True)
class Assignment:
    """What a worker serves: its slots and the ranks it forms a torch.distributed group with."""

    worker_id: str
    lease_id: int
    """etcd lease the assignment is attached to; it ends when the lease does."""
    slots: tuple[Slot, ...]
    """Consecutive ranks of one dp replica, in rank order."""
    peers: tuple[Peer, ...]
    """Every rank of the replica, this worker's own included, indexed by rank."""
    revision: int
    """etcd revision this view of the assignment was read or written at."""

    def __post_init__(self) -> None:
        if not self.slots:
            raise ValueError(f"an assignment needs at least one slot, got {self.slots!r}")
        first = self.slots[0]
        ranks = [slot.rank for slot in self.slots]
        if any(slot.replica != first.replica for slot in self.slots) or ranks != list(
            range(first.rank, first.rank + len(ranks))
        ):
            raise ValueError(f"slots must be consecutive ranks of one replica, got {self.slots!r}")
        if [peer.rank for peer in self.peers] != list(range(first.world_size)):
            raise ValueError(f"peers must list ranks 0..{first.world_size - 1} in order, got {self.peers!r}")

    @property
    def role(self) -> Role:
        return self.slots[0].role

    @property
    def group_index(self) -> int:
        return self.slots[0].group_index

    @property
    def dp_replica(self) -> int:
        return self.slots[0].dp_replica

    @property
    def tp_rank(self) -> int:
        """tp rank of the first (or only) slot."""
        return self.slots[0].tp_rank

    @property
    def pp_rank(self) -> int:
        """pp rank of the first (or only) slot."""
        return self.slots[0].pp_rank

    @property
    def slot_ids(self) -> tuple[int, ...]:
        return tuple(slot.slot_id for slot in self.slots)

    @property
    def world_size(self) -> int:
        return self.slots[0].world_size

    @property
    def is_complete(self) -> bool:
        """True once every rank of the replica is filled (the group can form)."""
        return all(peer.worker_id is not None for peer in self.peers)


def _replicas(slots: Sequence[Slot]) -> list[list[Slot]]:
    """Slots grouped by replica, in slot order (slot order keeps a replica's ranks together)."""
    return [list(run) for _, run in groupby(slots, key=lambda slot: slot.replica)]


def choose_slots(
    slots: Sequence[Slot],
    occupied: Mapping[int, str],
    *,
    role: Role | None,
    num_gpu_ranks: int = 1,
    preferred_slot_ids: Iterable[int] = (),
) -> tuple[Slot, ...]:
    """The slots to give a new worker (see the module docstring for the policy).

    Raises AssignmentError if no replica could ever take the request and
    NoFreeSlotError if one could but its ranks are taken now.
    """
    if not isinstance(num_gpu_ranks, int) or num_gpu_ranks < 1:
        raise AssignmentError(f"num_gpu_ranks must be a positive integer, got {num_gpu_ranks!r}")
    what = f"{role.value} " if role is not None else ""
    replicas = [r for r in _replicas(slots) if role is None or r[0].role is role]
    if not replicas:
        raise AssignmentError(f"the spec has no {what}slots")
    largest = max(len(r) for r in replicas)
    if num_gpu_ranks > largest:
        raise AssignmentError(
            f"num_gpu_ranks={num_gpu_ranks} exceeds the {largest} ranks of the largest {what}replica"
        )
    runs = [
        tuple(replica[start : start + num_gpu_ranks])
        for replica in replicas
        for start in range(0, len(replica) - num_gpu_ranks + 1, num_gpu_ranks)
    ]
    free_runs = [run for run in runs if all(slot.slot_id not in occupied for slot in run)]
    if not free_runs:
        num_slots = sum(len(r) for r in replicas)
        num_taken = sum(1 for r in replicas for slot in r if slot.slot_id in occupied)
        unit = "a free slot" if num_gpu_ranks == 1 else f"{num_gpu_ranks} free consecutive ranks"
        raise NoFreeSlotError(f"no {what}replica has {unit}: {num_taken} of {num_slots} {what}slots are taken")
    preferred = tuple(sorted(preferred_slot_ids))
    for run in free_runs:
        if tuple(slot.slot_id for slot in run) == preferred:
            return run
    return free_runs[0]


def replica_peers(
    slots: Sequence[Slot],
    occupied: Mapping[int, str],
    addresses: Mapping[str, str],
    replica: tuple[int, int],
) -> tuple[Peer, ...]:
    """Every rank of `replica` ((group_index, dp_replica)) with the worker filling it, by rank."""
    members = sorted((slot for slot in slots if slot.replica == replica), key=lambda slot: slot.rank)
    peers = []
    for slot in members:
        worker_id = occupied.get(slot.slot_id)
        address = addresses.get(worker_id) if worker_id is not None else None
        if address is None:
            worker_id = None
        peers.append(Peer(rank=slot.rank, worker_id=worker_id, address=address))
    return tuple(peers)
