"""The router's load view: requests it has in flight on each worker, plus what workers report.

The in-flight count is exact for this router's own traffic and needs no
round trip; several router replicas each see only their share, which is why
a worker-reported load (num_running, KV usage) is taken when it is higher.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class ReportedLoad:
    """What a worker last said about itself."""

    num_running: int
    kv_usage: float | None = None
    """Fraction of KV blocks in use, in [0, 1]."""

    def __post_init__(self) -> None:
        if not isinstance(self.num_running, int) or self.num_running < 0:
            raise ValueError(f"num_running must be an integer >= 0, got {self.num_running!r}")
        if self.kv_usage is not None and not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"kv_usage must be in [0, 1] or None, got {self.kv_usage!r}")


class LoadTracker:
    """Per-worker in-flight counts (owned by one event loop)."""

    def __init__(self) -> None:
        self._in_flight: dict[str, int] = {}
        self._reported: dict[str, ReportedLoad] = {}

    def num_in_flight(self, worker_id: str) -> int:
        return self._in_flight.get(worker_id, 0)

    def num_running(self, worker_id: str) -> int:
        """The larger of our in-flight count and the worker's own report."""
        reported = self._reported.get(worker_id)
        return max(self.num_in_flight(worker_id), reported.num_running if reported else 0)

    def kv_usage(self, worker_id: str) -> float | None:
        reported = self._reported.get(worker_id)
        return reported.kv_usage if reported else None

    def report(self, worker_id: str, load: ReportedLoad) -> None:
        self._reported[worker_id] = load

    @contextlib.contextmanager
    def track(self, worker_id: str) -> Iterator[None]:
        """Counts one request on `worker_id` for the duration of the block."""
        self._in_flight[worker_id] = self._in_flight.get(worker_id, 0) + 1
        try:
            yield
        finally:
            remaining = self._in_flight[worker_id] - 1
            if remaining:
                self._in_flight[worker_id] = remaining
            else:
                del self._in_flight[worker_id]

    def forget(self, worker_id: str) -> None:
        """Drops the worker's report (it left); in-flight counts end with their requests."""
        self._reported.pop(worker_id, None)
