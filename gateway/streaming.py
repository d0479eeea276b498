"""HTTP plumbing for generation: server-sent events that notice a vanished client, and cancel-on-disconnect.

A client that goes away cancels its request downstream: the running Generate
calls are cancelled, and the router aborts the request on every worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class EventStreamResponse(StreamingResponse):
    """text/event-stream that stops (and closes its iterator) as soon as the client disconnects.

    Starlette's own StreamingResponse notices a disconnect only at its next
    write under ASGI 2.4 and leaves the iterator to the garbage collector; here
    a listener cancels the writer at once and the iterator is closed explicitly.
    """

    def __init__(self, content, headers=None, on_close: Callable[[], None] | None = None) -> None:
        """`on_close` runs once the response is over, even if its iterator never started."""
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **(headers or {})})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def write() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client is gone mid-write
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(write)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                if self._on_close is not None:
                    self._on_close()


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`, cancelling it (and raising ClientGone) if the client disconnects first.

    Call after the body was read: from then on, receive() only returns on disconnect.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
