"""Every etcd key splitserve reads or writes, built in one place.

Layout under ``<prefix>/<cluster>/`` (default prefix ``/splitserve``)::

    spec                    canonical --inference-shards text (written once)
    lifecycle               LifecycleStatus JSON (absent = RUNNING, weights_version 0)
    leader                  LeaderRecord JSON, attached to the leader's lease
    workers/<worker_id>     WorkerRecord JSON, attached to the worker's lease
    slots/<slot_id:06d>     worker_id filling the slot, attached to the same lease
    draining/<worker_id>    present while the worker drains, attached to the same lease

Attaching a worker's slot and draining keys to its lease makes etcd delete
them in the same revision as the worker key when the worker dies, so a slot
is never held by a dead worker and no sweeper is needed. Slot ids are
zero-padded so etcd's key order is slot order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]*")


def check_name(kind: str, value: object) -> str:
    """Validates a worker id, replica id or cluster name used as one key segment."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(
            f"{kind} must be letters, digits and . _ : @ - (not starting with a symbol), got {value!r}"
        )
    return value


@dataclass(frozen=True)
class ClusterKeys:
    """Key builder for one cluster; also used to parse keys back into ids."""

    cluster: str = "default"
    """Cluster name: several clusters can share one etcd."""
    prefix: str = "/splitserve"
    """Root of all splitserve keys in etcd."""

    def __post_init__(self) -> None:
        check_name("cluster", self.cluster)
        if not self.prefix.startswith("/") or self.prefix.endswith("/") or "//" in self.prefix:
            raise ValueError(f"prefix must start with '/' and not end with '/', got {self.prefix!r}")

    @property
    def root(self) -> bytes:
        """Prefix of every key of the cluster (watch this for any change)."""
        return f"{self.prefix}/{self.cluster}/".encode()

    @property
    def spec(self) -> bytes:
        return self.root + b"spec"

    @property
    def lifecycle(self) -> bytes:
        return self.root + b"lifecycle"

    @property
    def leader(self) -> bytes:
        return self.root + b"leader"

    @property
    def workers_prefix(self) -> bytes:
        return self.root + b"workers/"

    def worker(self, worker_id: str) -> bytes:
        return self.workers_prefix + check_name("worker_id", worker_id).encode()

    @property
    def slots_prefix(self) -> bytes:
        return self.root + b"slots/"

    def slot(self, slot_id: int) -> bytes:
        if not isinstance(slot_id, int) or slot_id < 0:
            raise ValueError(f"slot_id must be a non-negative integer, got {slot_id!r}")
        return self.slots_prefix + f"{slot_id:06d}".encode()

    @property
    def draining_prefix(self) -> bytes:
        return self.root + b"draining/"

    def draining(self, worker_id: str) -> bytes:
        return self.draining_prefix + check_name("worker_id", worker_id).encode()

    def worker_id_of(self, key: bytes) -> str | None:
        """The worker id of a workers/ or draining/ key; None for other keys."""
        for prefix in (self.workers_prefix, self.draining_prefix):
            if key.startswith(prefix):
                return key[len(prefix) :].decode()
        return None

    def slot_id_of(self, key: bytes) -> int | None:
        """The slot id of a slots/ key; None for other keys."""
        if not key.startswith(self.slots_prefix):
            return None
        return int(key[len(self.slots_prefix) :])
