"""Room on a decode worker: a Decode waits for it rather than fail a stream its client saw start.

A disaggregated request's first token comes from prefill, so by the time Decode is called the
client may be reading a stream. A burst beyond the engine's `max_requests`, or one of long
contexts that runs the pool out of KV blocks first, waits here (back-pressure; the wait shows in
`decode.queue`), bounded so the handoff's pins are still there when its turn comes:

    Decode ──▶ take_slot (≤ ADMISSION_WAIT_S, ≤ lease − LEASE_MARGIN_S) ──▶ import_when_room ──▶ stream ──▶ release
                   └─ RESOURCE_EXHAUSTED: the router tries another decode worker
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Awaitable, Callable

import grpc

from splitserve.engine.block_pool import NoFreeBlocksError

ADMISSION_WAIT_S = 30.0
"""Longest a Decode waits for room — a request slot when the engine runs `max_requests`, free KV
blocks to import into — (less when its handoff's lease ends sooner); after that it answers
RESOURCE_EXHAUSTED and the router tries another decode worker."""
LEASE_MARGIN_S = 1.0
"""A waiting import gives up this long before its handoff's lease ends (the pull needs the pins)."""
ROOM_POLL_S = 0.1
"""A waiting import also tries again this often (blocks freed without a request ending here)."""


def admission_wait_s(desc) -> float:
    """How long a request may wait for room: ADMISSION_WAIT_S, or less where its handoff's lease
    (the pins its pull needs) ends sooner."""
    wait_s = ADMISSION_WAIT_S
    if desc is not None and desc.lease_deadline_unix_ms:
        wait_s = min(wait_s, desc.lease_deadline_unix_ms / 1000 - time.time() - LEASE_MARGIN_S)
    return max(0.0, wait_s)


class DecodeAdmission:
    """The decode service's request slots (one per request admitted, imported or prefilled here,
    until its stream ends) and its wait for free blocks. Owned by the service's event loop."""

    def __init__(self, max_requests: int, metrics) -> None:
        self.max_requests = max_requests
        self._slots = asyncio.Semaphore(max_requests)
        self._metrics = metrics
        self._room_waiters: set[asyncio.Future] = set()
        """Imports waiting for blocks (`import_when_room`): woken when a request here ends."""

    async def take_slot(self, desc, context) -> None:
        """Wait for a slot; RESOURCE_EXHAUSTED (through `context`) when none frees in time."""
        if not self._slots.locked():
            await self._slots.acquire()
            return
        wait_s = admission_wait_s(desc)
        try:
            await asyncio.wait_for(self._slots.acquire(), wait_s)
        except TimeoutError:
            self._metrics.rejections.labels("decode", "full").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"decode engine is full ({self.max_requests} requests running) and no slot freed "
                                f"within {wait_s:.1f} s")  # fmt: skip

    def release(self) -> None:
        """A request here ended (its blocks were freed by the engine before its stream ended): its
        slot goes back and the imports waiting for blocks try again now."""
        self._slots.release()
        for waiter in self._room_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._room_waiters.clear()

    def release_after(self, freeing: concurrent.futures.Future) -> None:
        """A request here was cut short (cancelled, failed): `freeing` is the engine's abort of it.
        Its slot goes back once that ran (or failed), so the imports woken by `release` find its
        blocks free rather than poll again. Call on the service's event loop."""
        loop = asyncio.get_running_loop()

        def done(_future) -> None:  # on the engine's thread
            try:
                loop.call_soon_threadsafe(self.release)
            except RuntimeError:  # the service's loop closed: nobody is waiting any more
                pass

        freeing.add_done_callback(done)

    async def import_when_room(self, submit: Callable[[], Awaitable], desc):
        """`submit()` an import; while the pool lacks free blocks for it (the running requests
        hold them: NoFreeBlocksError before anything is pulled), try again each time a request
        here ends — and every ROOM_POLL_S, for blocks freed otherwise (an aborted prefetch, an
        expired reservation) — within `admission_wait_s`."""
        deadline = time.monotonic() + admission_wait_s(desc)
        while True:
            try:
                return await submit()
            except NoFreeBlocksError as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NoFreeBlocksError(f"{exc} (waited for blocks to free)") from None
            waiter = asyncio.get_running_loop().create_future()
            self._room_waiters.add(waiter)
            try:
                await asyncio.wait_for(waiter, min(left, ROOM_POLL_S))
            except TimeoutError:
                pass
            finally:
                self._room_waiters.discard(waiter)
