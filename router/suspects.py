"""`SuspectList`: workers that just failed a call at the transport level, kept out of routing for a while.

A SIGKILLed or hung (SIGSTOPped) worker stays in the topology until its etcd lease
expires (one TTL, 10 s by default). Without this list every request routed to it in
that window would pay a failed call (a refused connection, or a whole deadline for a
hung one) before its retry. A worker that failed with UNAVAILABLE or DEADLINE_EXCEEDED
is skipped for `cooldown_s`, unless every worker of its role is suspect (then all are
tried: a wrong guess must not refuse requests). Forgiven early when it re-registers
(a new etcd lease: a new or resumed process).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc

from splitserve.router.messages import WorkerCallError

log = logging.getLogger(__name__)

SUSPECT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
"""Failures that say "this worker may be gone or hung", not "this request is bad" or "full"."""


class SuspectList:
    """Owned by the router's event loop (no locking)."""

    def __init__(self, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not cooldown_s >= 0:
            raise ValueError(f"cooldown_s must be >= 0, got {cooldown_s!r}")
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._until: dict[str, float] = {}

    def mark(self, worker_id: str, code: grpc.StatusCode) -> bool:
        """Records a failed call; True if it made the worker a suspect."""
        if code not in SUSPECT_CODES or self.cooldown_s == 0:
            return False
        self._until[worker_id] = self._clock() + self.cooldown_s
        return True

    def forgive(self, worker_id: str) -> None:
        self._until.pop(worker_id, None)

    def current(self) -> frozenset[str]:
        now = self._clock()
        for worker_id in [w for w, until in self._until.items() if until <= now]:
            del self._until[worker_id]
        return frozenset(self._until)


def note_failure(suspects: SuspectList, error: WorkerCallError) -> None:
    """A failed worker call: make its worker a suspect if the failure says it may be gone or hung."""
    if suspects.mark(error.worker_id, error.code):
        log.warning("worker %s failed %s (%s): not routing to it for %g s", error.worker_id, error.method,
                    error.code.name, suspects.cooldown_s)  # fmt: skip
