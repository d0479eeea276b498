"""Deadlines between the chunks of a Decode stream.

One deadline for the whole stream (`decode_timeout_s`) cannot tell a hung worker from a
long generation. These two can: the first chunk must come within `first_s` (the import
or the local prefill), and each later one within `stall_s` of the previous. A stream that
misses one raises WorkerCallError(DEADLINE_EXCEEDED); the caller cancels the call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator
from typing import TypeVar

import grpc

from splitserve.router.messages import WorkerCallError

T = TypeVar("T")


async def with_deadlines(stream: AsyncIterable[T], worker_id: str, first_s: float, stall_s: float) -> AsyncIterator[T]:
    """`stream`'s items; WorkerCallError(DEADLINE_EXCEEDED) when one is late."""
    iterator = aiter(stream)
    is_first = True
    while True:
        limit = first_s if is_first else stall_s
        try:
            async with asyncio.timeout(limit):
                item = await anext(iterator)
        except StopAsyncIteration:
            return
        except TimeoutError:
            what = "no first chunk" if is_first else "no chunk"
            raise WorkerCallError(
                worker_id, "Decode", grpc.StatusCode.DEADLINE_EXCEEDED, f"{what} within {limit:g} s (worker hung?)"
            ) from None
        is_first = False
        yield item
