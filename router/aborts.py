"""`AbortSender`: the Abort calls that free what a cancelled, failed or abandoned request holds on workers.

Each Abort runs as its own background task: it must outlive the request's task, which
is usually being cancelled (client gone) when it is sent. A failed Abort is only logged:
the worker's handoff lease frees the pins anyway, and a dead worker holds nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Protocol

from splitserve.router.messages import WorkerCallError
from splitserve.router.workers import WorkerEndpoint

log = logging.getLogger(__name__)


class _Aborter(Protocol):
    async def abort(self, worker: WorkerEndpoint, request_id: str, timeout_s: float) -> bool: ...


class AbortSender:
    """Owned by the router's event loop."""

    def __init__(self, client: _Aborter, timeout_s: float) -> None:
        self._client = client
        self._timeout_s = timeout_s
        self._tasks: set[asyncio.Task] = set()

    def send(self, worker: WorkerEndpoint, request_id: str) -> None:
        async def call() -> None:
            try:
                await self._client.abort(worker, request_id, self._timeout_s)
            except WorkerCallError as e:
                log.info("Abort of %s on %s failed: %s", request_id, worker.worker_id, e)

        task = asyncio.create_task(call(), name=f"abort-{request_id}-{worker.worker_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def send_all(self, workers: Iterable[WorkerEndpoint], request_id: str) -> None:
        for worker in workers:
            self.send(worker, request_id)

    async def wait(self) -> None:
        """Waits (at most one Abort deadline) for the calls still running."""
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self._timeout_s)
