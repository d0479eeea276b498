"""Router.Generate end to end over gRPC, against protocol-level worker doubles (router_doubles.py).

Covers: first token sent exactly once, aggregated serving, prefill retry,
decode retry before the first token (same handoff / recompute), client
cancellation and Router.Abort reaching every worker, RESOURCE_EXHAUSTED
and the other status codes.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from splitserve.proto.v1 import common_pb2, router_pb2, router_pb2_grpc
from splitserve.router.config import RouterConfig
from splitserve.router.policy import PolicyConfig
from splitserve.router.server import RouterServer
from tests.router.router_doubles import DecodeDouble, PrefillDouble, first_token_of, serving

BS = 4
PROMPT = list(range(10, 22))  # 12 tokens, 3 blocks


@contextlib.asynccontextmanager
async def router(endpoints, **overrides):
    fields = dict(block_size=BS, kv_events=False, control_timeout_s=2.0, policy=PolicyConfig(policy="load_balanced"))
    server = RouterServer(RouterConfig(**(fields | overrides)), static_workers=endpoints)
    await server.start()
    channel = grpc.aio.insecure_channel(server.address)
    try:
        yield server, router_pb2_grpc.RouterStub(channel)
    finally:
        await channel.close()
        await server.stop()


def request(request_id: str, num_tokens: int = 5, **flags) -> router_pb2.GenerateRequest:
    params = common_pb2.SamplingParams(num_tokens_to_generate=num_tokens, return_log_probs=True)
    return router_pb2.GenerateRequest(request_id=request_id, token_ids=PROMPT, sampling_params=params, **flags)


async def collect(stub, message) -> list[router_pb2.GenerateChunk]:
    return [chunk async for chunk in stub.Generate(message)]


def tokens_of(chunks) -> list[int]:
    return [t for chunk in chunks for t in chunk.token_ids]


async def eventually(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_disaggregated_stream_sends_the_first_token_exactly_once():
    p0, d0 = PrefillDouble("p0"), DecodeDouble("d0")
    p0.num_cached_tokens = 8
    d0.tp = 2  # the prefill worker is told, to pack the handoff's head slices for it
    async with serving(p0, d0) as endpoints, router(endpoints) as (_, stub):
        chunks = await collect(stub, request("r1", return_timing=True))
    first = first_token_of(PROMPT)
    assert tokens_of(chunks) == [first, first + 1, first + 2, first + 3, first + 4]
    assert [lp for c in chunks for lp in c.logprobs] == [-0.5, -2.0, -3.0, -4.0, -5.0]
    assert chunks[0].token_ids == [first]  # sent as soon as prefill answered, before decode
    last = chunks[-1]
    assert [c.finish_reason for c in chunks[:-1]] == [0] * (len(chunks) - 1)
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_tokens) == (12, 5, 8)
    assert (last.routing.prefill_worker_id, last.routing.decode_worker_id) == ("p0", "d0")
    assert (last.routing.num_prefill_attempts, last.routing.num_decode_attempts) == (1, 1)
    assert last.routing.num_transfer_blocks == 3 and last.routing.reason.startswith("disaggregated")
    assert 0 < last.timing.time_to_first_token_ms <= last.timing.total_ms
    assert not any(c.HasField("usage") for c in chunks[:-1])
    (prefill_request,) = p0.requests
    assert (prefill_request.decode_worker_id, prefill_request.decode_tp) == ("d0", 2)
    (decode_request,) = d0.requests
    assert decode_request.handoff.first_token_id == first and decode_request.prefill_address == endpoints["p0"].address
    assert p0.aborted == [] and d0.aborted == []


async def test_first_token_that_finishes_skips_decode():
    p0, d0 = PrefillDouble("p0"), DecodeDouble("d0")
    async with serving(p0, d0) as endpoints, router(endpoints) as (_, stub):
        chunks = await collect(stub, request("r1", num_tokens=1))
    assert tokens_of(chunks) == [first_token_of(PROMPT)] and len(chunks) == 1
    assert chunks[0].finish_reason == common_pb2.FINISH_REASON_LENGTH and chunks[0].usage.completion_tokens == 1
    assert d0.requests == []


async def test_aggregated_without_prefill_workers_and_enforce_disagg_error():
    d0 = DecodeDouble("d0")
    d0.num_cached_tokens = 4
    async with serving(d0) as endpoints, router(endpoints) as (_, stub):
        chunks = await collect(stub, request("r1", num_tokens=3))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await collect(stub, request("r2", enforce_disagg=True))
    first = first_token_of(PROMPT)
    assert tokens_of(chunks) == [first, first + 1, first + 2]
    assert not d0.requests[0].HasField("handoff")
    assert chunks[-1].usage.cached_tokens == 4 and chunks[-1].routing.prefill_worker_id == ""
    assert chunks[-1].routing.reason.startswith("aggregated: no prefill worker")
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "enforce_disagg" in error.value.details()


async def test_prefill_failure_is_retried_on_another_prefill_worker():
    p0, p1, d0 = PrefillDouble("p0"), PrefillDouble("p1"), DecodeDouble("d0")
    p0.fail_with = [grpc.StatusCode.UNAVAILABLE]
    async with serving(p0, p1, d0) as endpoints, router(endpoints) as (_, stub):
        chunks = await collect(stub, request("r1"))
        await eventually(lambda: p0.aborted == ["r1"])  # the failed worker may have pinned blocks
    first = first_token_of(PROMPT)
    assert tokens_of(chunks) == [first + i for i in range(5)]
    assert [len(p0.requests), len(p1.requests)] == [1, 1]
    routing = chunks[-1].routing
    assert (routing.prefill_worker_id, routing.num_prefill_attempts) == ("p1", 2)
    assert "prefill on p0 failed (UNAVAILABLE)" in routing.reason
    assert d0.requests[0].prefill_address == endpoints["p1"].address


async def test_every_prefill_failing_falls_back_to_aggregated_unless_enforced():
    p0, d0 = PrefillDouble("p0"), DecodeDouble("d0")
    p0.fail_with = [grpc.StatusCode.INTERNAL] * 2
    async with serving(p0, d0) as endpoints, router(endpoints) as (_, stub):
        chunks = await collect(stub, request("r1", num_tokens=2))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await collect(stub, request("r2", enforce_disagg=True))
    assert tokens_of(chunks) == [first_token_of(PROMPT), first_token_of(PROMPT) + 1]
    assert chunks[-1].routing.prefill_worker_id == "" and "serving aggregated" in chunks[-1].routing.reason
    assert not d0.requests[0].HasField("handoff")
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE  # worth retrying, unlike a missing prefill pool
    assert "every prefill attempt failed and enforce_disagg is set" in error.value.details()


async def test_unreachable_decode_worker_is_retried_with_the_same_handoff():
    p0, d0, d1 = PrefillDouble("p0"), DecodeDouble("d0"), DecodeDouble("d1")
    d0.fail_with = [grpc.StatusCode.UNAVAILABLE]
    async with serving(p0, d0, d1) as endpoints, router(endpoints) as (_, stub):
        chunks = await collect(stub, request("r1"))
        await eventually(lambda: d0.aborted == ["r1"])
    first = first_token_of(PROMPT)
    assert tokens_of(chunks) == [first + i for i in range(5)]
    assert d1.requests[0].handoff.first_token_id == first
    assert (chunks[-1].routing.decode_worker_id, chunks[-1].routing.num_decode_attempts) == ("d1", 2)
    assert p0.aborted == []  # the pinned copy was used, not dropped


async def test_failed_transfer_is_recomputed_on_another_decode_worker():
    p0, d0, d1 = PrefillDouble("p0"), DecodeDouble("d0"), DecodeDouble("d1")
    d0.fail_with = [grpc.StatusCode.INTERNAL]
    async with serving(p0, d0, d1) as endpoints, router(endpoints) as (_, stub):
        chunks = await collect(stub, request("r1"))
        await eventually(lambda: p0.aborted == ["r1"])  # nobody will pull the pinned copy: unpinned
    first = first_token_of(PROMPT)
    (retry,) = d1.requests
    assert not retry.HasField("handoff")
    assert list(retry.token_ids) == PROMPT + [first] and retry.sampling_params.num_tokens_to_generate == 4
    second = first_token_of(PROMPT + [first])
    assert tokens_of(chunks) == [first, second, second + 1, second + 2, second + 3]
    assert chunks[-1].usage.completion_tokens == 5 and "recomputing" in chunks[-1].routing.reason


async def test_client_cancellation_aborts_prefill_and_decode():
    p0, d0 = PrefillDouble("p0"), DecodeDouble("d0")
    d0.hold_after_first = asyncio.Event()
    async with serving(p0, d0) as endpoints, router(endpoints) as (server, stub):
        call = stub.Generate(request("r1"))
        first = await call.read()
        assert list(first.token_ids) == [first_token_of(PROMPT)]
        await eventually(lambda: len(d0.requests) == 1)
        call.cancel()
        await eventually(lambda: p0.aborted == ["r1"] and d0.aborted == ["r1"])
        await eventually(lambda: server.orchestrator.num_in_flight == 0)


async def test_router_abort_ends_the_stream_with_abort():
    p0, d0 = PrefillDouble("p0"), DecodeDouble("d0")
    d0.hold_after_first = asyncio.Event()
    async with serving(p0, d0) as endpoints, router(endpoints) as (_, stub):
        call = stub.Generate(request("r1"))
        await call.read()
        await eventually(lambda: len(d0.requests) == 1)
        reply = await stub.Abort(common_pb2.AbortRequest(request_id="r1"))
        rest = await collect_rest(call)
        unknown = await stub.Abort(common_pb2.AbortRequest(request_id="nope"))
    assert reply.was_found and not unknown.was_found
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert d0.aborted == ["r1"] and p0.aborted == ["r1"]


async def test_over_capacity_is_refused_early_with_resource_exhausted():
    p0, d0 = PrefillDouble("p0"), DecodeDouble("d0")
    d0.hold_after_first = asyncio.Event()
    async with serving(p0, d0) as endpoints, router(endpoints, max_in_flight=1) as (_, stub):
        call = stub.Generate(request("r1"))
        await call.read()
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await collect(stub, request("r2"))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_in_flight=1" in error.value.details()
        assert len(p0.requests) == 1  # refused before any work
        d0.hold_after_first.set()
        rest = await collect_rest(call)
        assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


async def test_bad_requests_duplicates_and_no_workers():
    p0, d0 = PrefillDouble("p0"), DecodeDouble("d0")
    d0.hold_after_first = asyncio.Event()
    async with serving(p0, d0) as endpoints, router(endpoints) as (server, stub):
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await collect(stub, router_pb2.GenerateRequest(request_id="x", sampling_params=request("x").sampling_params))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in error.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await collect(stub, request("x", num_tokens=0))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "got 0" in error.value.details()
        call = stub.Generate(request("r1"))
        await call.read()
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await collect(stub, request("r1"))
        assert error.value.code() == grpc.StatusCode.ALREADY_EXISTS
        d0.hold_after_first.set()
        await collect_rest(call)
        server.set_workers({"p0": endpoints["p0"]})
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await collect(stub, request("r2"))
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "no routable decode worker" in error.value.details()


async def collect_rest(call) -> list[router_pb2.GenerateChunk]:
    """The remaining chunks of a call already read with read() (gRPC forbids mixing in iteration)."""
    chunks = []
    while (chunk := await call.read()) is not grpc.aio.EOF:
        chunks.append(chunk)
    return chunks


async def test_ttft_slo_admission_refuses_what_cannot_meet_it():
    p0, d0 = PrefillDouble("p0"), DecodeDouble("d0")
    # 12 prompt tokens at 10 tokens/s on one prefill worker: predicted TTFT 1.2 s.
    async with serving(p0, d0) as endpoints, router(endpoints, ttft_slo_s=1.0, prefill_tokens_per_s=10.0) as (_, stub):
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await collect(stub, request("slow"))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "predicted time to first token 1.20 s exceeds the TTFT SLO of 1 s" in error.value.details()
        assert not p0.requests  # refused before any work
    async with serving(p0, d0) as endpoints, router(endpoints, ttft_slo_s=1.0, prefill_tokens_per_s=100.0) as (_, stub):
        chunks = await collect(stub, request("fast"))
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
