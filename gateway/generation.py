"""Running choices against the router: one Generate stream per choice, merged for streaming responses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

from splitserve.client import AsyncClient, SamplingParams
from splitserve.gateway.choice_output import ChoiceDelta, ChoiceOutput

T = TypeVar("T")

MAX_TOKENS_AFTER_STOP = 16
"""Tokens read past a matched stop string (waiting for the router's usage) before dropping the stream."""


async def run_choice(
    client: AsyncClient, request_id: str, prompt_ids: list[int], params: SamplingParams, output: ChoiceOutput
) -> AsyncIterator[ChoiceDelta]:
    """Yields the choice's deltas; when it ends, `output.finish_reason` and `output.usage` are set.

    Raises the SDK's SplitserveError subclasses. Closing the iterator early
    cancels the Generate call, and with it the request on every worker.
    """
    num_after_stop = 0
    async for chunk in client.stream_token_ids(request_id, prompt_ids, params):
        was_stopped = output.is_stopped_by_string
        delta = output.add(chunk)
        if was_stopped and chunk.result is None:
            num_after_stop += len(chunk.token_ids)
            if num_after_stop > MAX_TOKENS_AFTER_STOP:
                output.finish_early()
        if delta.text or delta.logprobs or delta.prompt_logprobs:
            yield delta
        if output.usage is not None:
            return


async def merge(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[T]:
    """Items of several async iterators as they come.

    The first exception is raised after the others are cancelled; leaving
    early (or being cancelled) cancels every stream.
    """
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((item, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((None, e))
        finally:
            queue.put_nowait((done, None))

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                remaining -= 1
                continue
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
