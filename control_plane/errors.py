"""Errors of the control plane's operations; service.py maps each to one gRPC status code.

(Policy errors live next to their policy: ShardSpecError in shard_spec.py,
AssignmentError / NoFreeSlotError in assignment.py, LifecycleError in
lifecycle.py.)
"""

from __future__ import annotations

from splitserve.control_plane.records import LeaderRecord


class NotLeaderError(RuntimeError):
    """A state-changing call reached a follower; `leader` is who to ask instead (None = unknown)."""

    def __init__(self, leader: LeaderRecord | None) -> None:
        where = f"the leader is {leader.replica_id} at {leader.address}" if leader else "no leader is elected"
        super().__init__(f"this control-plane replica is not the leader; {where}")
        self.leader = leader


class LeaseNotAliveError(LookupError):
    """A worker registered with an etcd lease that does not exist (expired or never granted)."""


class AlreadyRegisteredError(RuntimeError):
    """The worker id is registered on another, still live lease."""


class WorkerNotFoundError(LookupError):
    """The worker id is not registered (never was, or its lease ended)."""


class SpecMismatchError(RuntimeError):
    """etcd already holds a cluster with a different --inference-shards spec."""
