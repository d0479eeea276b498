"""Cluster lifecycle for reinforcement-learning loops: pause, suspend, reload weights.

States and the actions between them (names follow the reference design's
pause / unpause / suspend / resume)::

    RUNNING --PAUSE--> PAUSED --SUSPEND--> SUSPENDED --RELOAD_WEIGHTS--> SUSPENDED
    RUNNING <-UNPAUSE- PAUSED <--RESUME--- SUSPENDED

PAUSED stops scheduling but keeps requests and KV; SUSPENDED also frees GPU
buffers (KV cache, SSM state) while keeping the processes, which is when new
weights can be loaded. An action that is already satisfied (PAUSE while
PAUSED) is a no-op, so a retried call is harmless. The control plane stores
the status in etcd; workers follow it through the topology watch.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, replace


class LifecycleState(enum.StrEnum):
    RUNNING = "running"
    PAUSED = "paused"
    SUSPENDED = "suspended"


class LifecycleAction(enum.StrEnum):
    PAUSE = "pause"
    UNPAUSE = "unpause"
    SUSPEND = "suspend"
    RESUME = "resume"
    RELOAD_WEIGHTS = "reload_weights"


class LifecycleError(ValueError):
    """An action not allowed in the current state; the message says what to do first."""


@dataclass(frozen=True)
class LifecycleStatus:
    state: LifecycleState = LifecycleState.RUNNING
    weights_version: int = 0
    """Incremented by every RELOAD_WEIGHTS; a worker reloads when its own is older."""
    checkpoint_path: str | None = None
    """Checkpoint of the latest RELOAD_WEIGHTS; None before the first."""

    def __post_init__(self) -> None:
        if not isinstance(self.state, LifecycleState):
            raise ValueError(f"state must be a LifecycleState, got {self.state!r}")
        if not isinstance(self.weights_version, int) or self.weights_version < 0:
            raise ValueError(f"weights_version must be a non-negative integer, got {self.weights_version!r}")
        if self.checkpoint_path is not None and not self.checkpoint_path:
            raise ValueError("checkpoint_path must be None or non-empty, got ''")

    def encode(self) -> bytes:
        fields = {"state": self.state.value, "weights_version": self.weights_version}
        fields["checkpoint_path"] = self.checkpoint_path
        return json.dumps(fields, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> LifecycleStatus:
        fields = json.loads(data)
        return cls(LifecycleState(fields["state"]), fields["weights_version"], fields["checkpoint_path"])


# action -> (states it applies to, resulting state)
_TRANSITIONS = {
    LifecycleAction.PAUSE: ((LifecycleState.RUNNING,), LifecycleState.PAUSED),
    LifecycleAction.UNPAUSE: ((LifecycleState.PAUSED,), LifecycleState.RUNNING),
    LifecycleAction.SUSPEND: ((LifecycleState.PAUSED,), LifecycleState.SUSPENDED),
    LifecycleAction.RESUME: ((LifecycleState.SUSPENDED,), LifecycleState.PAUSED),
}
_FIRST = {
    (LifecycleAction.SUSPEND, LifecycleState.RUNNING): "PAUSE first",
    (LifecycleAction.RESUME, LifecycleState.RUNNING): "it is not suspended",
    (LifecycleAction.UNPAUSE, LifecycleState.SUSPENDED): "RESUME first",
    (LifecycleAction.PAUSE, LifecycleState.SUSPENDED): "it is already paused and suspended",
}


def apply_action(
    status: LifecycleStatus, action: LifecycleAction, checkpoint_path: str | None = None
) -> LifecycleStatus:
    """The status after `action`; raises LifecycleError if not allowed from `status.state`."""
    if action is LifecycleAction.RELOAD_WEIGHTS:
        if not checkpoint_path:
            raise LifecycleError("RELOAD_WEIGHTS needs a checkpoint_path")
        if status.state is not LifecycleState.SUSPENDED:
            raise LifecycleError(f"cannot RELOAD_WEIGHTS while {status.state.name}: SUSPEND first")
        return replace(status, weights_version=status.weights_version + 1, checkpoint_path=checkpoint_path)
    if checkpoint_path:
        raise LifecycleError(f"checkpoint_path is only for RELOAD_WEIGHTS, got {checkpoint_path!r} with {action.name}")
    sources, target = _TRANSITIONS[action]
    if status.state is target:
        return status
    if status.state not in sources:
        hint = _FIRST.get((action, status.state), "not allowed")
        raise LifecycleError(f"cannot {action.name} while {status.state.name}: {hint}")
    return replace(status, state=target)
