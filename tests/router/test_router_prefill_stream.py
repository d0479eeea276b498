"""The router over PrefillStream (router/prefill_call.py), against the protocol-level doubles:
the first token reaches the client before the prefill worker has published its handoff, and
a stream that breaks between the two goes on from prompt + first token, never repeating it."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from splitserve.router.messages import DecodeTiming, PrefillTiming
from splitserve.router.timing import RouterTimes, phases
from tests.router.router_doubles import DecodeDouble, PrefillDouble, first_token_of, serving
from tests.router.test_router_orchestrator import (
    PROMPT,
    collect,
    collect_rest,
    eventually,
    request,
    router,
    tokens_of,
)


async def test_first_token_reaches_the_client_before_the_prefill_result():
    p0, d0 = PrefillDouble("p0"), DecodeDouble("d0")
    p0.hold_result = asyncio.Event()  # the handoff is "being published" until the test has the token
    async with serving(p0, d0) as endpoints, router(endpoints) as (_, stub):
        call = stub.Generate(request("r1"))
        first = await asyncio.wait_for(call.read(), 5)
        assert list(first.token_ids) == [first_token_of(PROMPT)] and list(first.logprobs) == [-0.5]
        assert d0.requests == [] and not p0.hold_result.is_set()  # no result yet, so no Decode either
        p0.hold_result.set()
        rest = await collect_rest(call)
    f = first_token_of(PROMPT)
    assert tokens_of([first, *rest]) == [f + i for i in range(5)]  # the decode's echo of it is dropped
    (decode_request,) = d0.requests
    assert decode_request.handoff.first_token_id == f and p0.aborted == []
    assert rest[-1].routing.num_prefill_attempts == 1 and rest[-1].usage.completion_tokens == 5


async def test_failure_after_the_first_token_goes_on_from_prompt_plus_first_token():
    p0, p1, d0 = PrefillDouble("p0"), PrefillDouble("p1"), DecodeDouble("d0")
    for double in (p0, p1):  # whichever gets the request fails once its token is out
        double.fail_after_first = [grpc.StatusCode.UNAVAILABLE]
    async with serving(p0, p1, d0) as endpoints, router(endpoints) as (_, stub):
        chunks = await collect(stub, request("r1"))
        prefill = p0 if p0.requests else p1
        await eventually(lambda: prefill.aborted == ["r1"])  # its request (maybe pinned) is dropped
    assert len(p0.requests) + len(p1.requests) == 1  # not retried: the token is out
    first = first_token_of(PROMPT)
    (decode_request,) = d0.requests
    assert not decode_request.HasField("handoff")
    assert list(decode_request.token_ids) == PROMPT + [first]
    assert decode_request.sampling_params.num_tokens_to_generate == 4
    second = first_token_of(PROMPT + [first])
    assert tokens_of(chunks) == [first, second, second + 1, second + 2, second + 3]  # the first token once
    last = chunks[-1]
    assert last.usage.completion_tokens == 5 and last.routing.num_prefill_attempts == 1
    assert "failed after its first token (UNAVAILABLE)" in last.routing.reason


async def test_request_error_after_the_first_token_still_fails_the_request():
    p0, d0 = PrefillDouble("p0"), DecodeDouble("d0")
    p0.fail_after_first = [grpc.StatusCode.INVALID_ARGUMENT]
    async with serving(p0, d0) as endpoints, router(endpoints) as (_, stub):
        call = stub.Generate(request("r1"))
        first = await call.read()
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await collect_rest(call)
    assert list(first.token_ids) == [first_token_of(PROMPT)]
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and d0.requests == []


async def test_failure_before_the_first_token_is_still_retried_elsewhere():
    p0, p1, d0 = PrefillDouble("p0"), PrefillDouble("p1"), DecodeDouble("d0")
    p0.fail_with, p1.fail_with = [grpc.StatusCode.UNAVAILABLE], []
    async with serving(p0, p1, d0) as endpoints, router(endpoints) as (_, stub):
        chunks = await collect(stub, request("r1"))
    first = first_token_of(PROMPT)
    assert tokens_of(chunks) == [first + i for i in range(5)]
    assert chunks[-1].routing.num_prefill_attempts == (2 if p0.requests else 1) and d0.requests[0].HasField(
        "handoff"
    )


def test_streamed_prefill_timing_takes_the_publication_off_the_ttft_path():
    times = RouterTimes(
        route_ms=1, prefill_retry_ms=0, prefill_call_ms=45, decode_first_chunk_ms=9, relay_ms=0.5
    )
    streamed = PrefillTiming(
        handler_ms=50, queue_ms=2, compute_ms=40, publish_ms=6, num_chunks=3, first_token_ms=42.5
    )
    out = phases(times, streamed, DecodeTiming(queue_ms=1, transfer_ms=3, first_chunk_ms=5, stream_ms=30))
    ttft = {p.name: p.ms for p in out if p.is_ttft}
    assert ttft == {"router.route": 1, "rpc.prefill": 2.5, "prefill.queue": 2, "prefill.compute": 40,
                    "prefill.emit": 0.5, "router.first_token": 0.5}  # fmt: skip
    assert sum(ttft.values()) == pytest.approx(1 + 45 + 0.5)  # route + call to the first token + relay
    assert "handoff.publish" in {p.name for p in out if not p.is_ttft}


async def test_a_handoff_preview_reaches_the_decode_workers_prefetch_before_decode():
    """Layer-wise streaming: the preview goes to the chosen decode worker's Prefetch at once, and
    Decode (with the full handoff) waits for that call, so the worker sees them in that order."""
    p0, d0 = PrefillDouble("p0"), DecodeDouble("d0")
    p0.send_preview = True
    d0.prefetch_delay_s = 0.3  # slower than the rest of the prefill: Decode must still come after it
    async with serving(p0, d0) as endpoints, router(endpoints) as (server, stub):
        chunks = await collect(stub, request("r1"))
        assert d0.events == [("Prefetch", "r1"), ("Decode", "r1")]
        assert d0.requests[0].handoff.first_token_id == first_token_of(PROMPT)  # the full handoff, not the preview
        assert server.metrics.prefetches.labels("accepted")._value.get() == 1
    assert tokens_of(chunks) == [first_token_of(PROMPT) + i for i in range(5)]


async def test_a_prefill_failing_after_its_preview_is_retried_and_the_decode_worker_still_serves():
    p0, p1, d0 = PrefillDouble("p0"), PrefillDouble("p1"), DecodeDouble("d0")
    for double in (p0, p1):
        double.send_preview = True
        # the forward pass after the preview: long enough for each attempt's Prefetch to reach d0
        # (a second preview cancels the first attempt's call, which may then never arrive)
        double.after_preview_s = 0.3
    failing = [grpc.StatusCode.UNAVAILABLE]
    p0.fail_after_preview = p1.fail_after_preview = failing  # shared: only the first attempt fails
    d0.prefetch_accepts = False  # a declined prefetch changes nothing for the client
    async with serving(p0, p1, d0) as endpoints, router(endpoints) as (_, stub):
        chunks = await collect(stub, request("r1"))
    assert len(p0.requests) + len(p1.requests) == 2  # failed before the first token: retried
    assert d0.prefetched == ["r1", "r1"] and [e for e, _ in d0.events][-1] == "Decode"
    assert tokens_of(chunks) == [first_token_of(PROMPT) + i for i in range(5)]


async def test_a_preview_whose_request_ends_at_its_first_token_frees_the_decode_workers_prefetch():
    p0, d0 = PrefillDouble("p0"), DecodeDouble("d0")
    p0.send_preview = True  # e.g. the first token was a stop token: no handoff after all
    async with serving(p0, d0) as endpoints, router(endpoints) as (_, stub):
        chunks = await collect(stub, request("r1", num_tokens=1))
        await eventually(lambda: d0.aborted == ["r1"])  # its reserved blocks go back at once
    assert d0.prefetched == ["r1"] and d0.requests == []
    assert tokens_of(chunks) == [first_token_of(PROMPT)]


async def test_an_abort_while_decode_waits_for_the_prefetch_ends_the_stream_without_a_decode_call():
    from splitserve.proto.v1 import common_pb2

    p0, d0 = PrefillDouble("p0"), DecodeDouble("d0")
    p0.send_preview = True
    d0.prefetch_delay_s = 1.0  # the relay is waiting for it when the Abort comes
    async with serving(p0, d0) as endpoints, router(endpoints) as (_, stub):
        call = stub.Generate(request("r1"))
        await call.read()  # the first token
        reply = await stub.Abort(common_pb2.AbortRequest(request_id="r1"))
        rest = await collect_rest(call)
        await eventually(lambda: d0.aborted.count("r1") == 2)  # again once the late Prefetch was taken up
    assert d0.prefetched == ["r1"] and d0.events[-1] == ("Prefetch", "r1")
    assert reply.was_found and rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert d0.requests == []  # no Decode after the Abort: nothing would have stopped it


async def test_a_decode_worker_that_does_not_answer_its_prefetch_is_skipped_and_the_handoff_reused():
    """A hung decode worker shows itself at the Prefetch: the relay counts that as its failed attempt
    and sends Decode elsewhere at once, with the same handoff (a prefetch only read the pinned copy)."""
    p0, d0, d1 = PrefillDouble("p0"), DecodeDouble("d0"), DecodeDouble("d1")
    p0.send_preview = True
    d0.prefetch_hangs = d1.prefetch_hangs = [1.5]  # shared: whichever is chosen first hangs
    async with serving(p0, d0, d1) as endpoints, router(endpoints, control_timeout_s=0.5) as (_, stub):
        chunks = await collect(stub, request("r1"))
        hung, served = (d0, d1) if d1.requests else (d1, d0)
        await eventually(lambda: hung.aborted == ["r1"])  # it may have reserved blocks
    assert hung.requests == [] and [r.request_id for r in served.requests] == ["r1"]
    assert served.requests[0].HasField("handoff")  # pulled from the pinned copy, not recomputed
    routing = chunks[-1].routing
    assert routing.num_decode_attempts == 2 and f"decode on {hung.worker_id} failed (DEADLINE_EXCEEDED)" in routing.reason
    assert tokens_of(chunks) == [first_token_of(PROMPT) + i for i in range(5)]


async def test_an_unanswered_prefetch_of_a_failed_prefill_attempt_does_not_count_against_the_retry():
    """The retry's preview goes to the same decode worker, which answers it this time: that worker
    decodes (the first attempt's unanswered Prefetch is forgotten with the attempt)."""
    p0, p1, d0 = PrefillDouble("p0"), PrefillDouble("p1"), DecodeDouble("d0")
    failing = [grpc.StatusCode.UNAVAILABLE]
    for double in (p0, p1):
        double.send_preview, double.after_preview_s = True, 0.8
        double.fail_after_preview = failing  # shared: only the first attempt fails, after its Prefetch did
    d0.prefetch_hangs = [1.5]  # the first Prefetch gets no answer within the control timeout
    async with serving(p0, p1, d0) as endpoints, router(endpoints, control_timeout_s=0.5) as (_, stub):
        chunks = await collect(stub, request("r1"))
    assert len(p0.requests) + len(p1.requests) == 2 and [r.request_id for r in d0.requests] == ["r1"]
    assert chunks[-1].routing.num_decode_attempts == 1
    assert tokens_of(chunks) == [first_token_of(PROMPT) + i for i in range(5)]
