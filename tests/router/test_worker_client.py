"""`GrpcWorkerClient` when a worker leaves the topology with calls still running on its channel:
they go on for a grace period (a lapsed etcd lease need not kill a stream), and a call whose channel
closes under it fails as that worker's UNAVAILABLE (retried elsewhere), never as a CancelledError
that would cancel the request's task and leave its client waiting for a deadline."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from splitserve.router.messages import GenerateRequest, SamplingParams, WorkerCallError
from splitserve.router.worker_client import GrpcWorkerClient
from tests.router.router_doubles import DecodeDouble, serving

REQUEST = GenerateRequest("r1", tuple(range(10, 22)), SamplingParams(num_tokens_to_generate=4, temperature=0))


async def _held_stream(grace_s: float):
    """A Decode stream held after its first chunk, the client, and the double."""
    d0 = DecodeDouble("d0")
    d0.hold_after_first = asyncio.Event()
    return d0, GrpcWorkerClient(departed_grace_s=grace_s)


async def test_calls_on_a_departed_workers_channel_finish_within_the_grace():
    d0, client = await _held_stream(grace_s=10.0)
    async with serving(d0) as endpoints:
        stream = aiter(client.decode(endpoints["d0"], REQUEST, None, None, timeout_s=10))
        first = await anext(stream)
        closing = asyncio.create_task(client.set_workers({}))  # d0 left the topology
        await asyncio.sleep(0.2)
        d0.hold_after_first.set()
        rest = [output async for output in stream]
        await asyncio.wait_for(closing, 5)  # the channel closed once its last call ended
        await client.close()
    assert [t for o in [first, *rest] for t in o.tokens.token_ids] == [first.tokens.token_ids[0] + i for i in range(4)]


async def test_a_call_whose_channel_closes_under_it_fails_unavailable_not_cancelled():
    d0, client = await _held_stream(grace_s=0.0)
    async with serving(d0) as endpoints:
        stream = aiter(client.decode(endpoints["d0"], REQUEST, None, None, timeout_s=10))
        await anext(stream)
        await client.set_workers({})  # no grace: closed at once
        with pytest.raises(WorkerCallError) as caught:
            await anext(stream)
        d0.hold_after_first.set()
        await client.close()
    assert caught.value.code is grpc.StatusCode.UNAVAILABLE and "channel closed" in caught.value.details


async def test_a_cancelled_task_stays_cancelled():
    """The conversion is only for calls cancelled under a running task: cancelling the request's own
    task (its client went away) still cancels it."""
    d0, client = await _held_stream(grace_s=0.0)
    async with serving(d0) as endpoints:

        async def consume() -> None:
            async for _ in client.decode(endpoints["d0"], REQUEST, None, None, timeout_s=10):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.3)  # held after the first chunk
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        d0.hold_after_first.set()
        await client.close()
