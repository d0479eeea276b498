"""The router's defences against dead and hung workers: per-chunk Decode deadlines, a retry that
recomputes once the decode worker has pulled the handoff, a clear UNAVAILABLE once tokens went out,
and suspects (workers that just failed UNAVAILABLE / DEADLINE_EXCEEDED) kept out of routing.
Real processes: tests/reliability/."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from splitserve.control_plane.shard_spec import Role
from splitserve.router.cluster_view import ClusterView
from splitserve.router.messages import WorkerCallError
from splitserve.router.stream_deadlines import with_deadlines
from splitserve.router.suspects import SuspectList
from splitserve.router.workers import WorkerEndpoint
from tests.router.router_doubles import DecodeDouble, PrefillDouble, first_token_of, serving
from tests.router.test_router_orchestrator import PROMPT, collect, eventually, request, router, tokens_of


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_suspects_expire_and_only_transport_failures_count():
    clock = Clock()
    suspects = SuspectList(10.0, clock)
    assert suspects.mark("w1", grpc.StatusCode.UNAVAILABLE)
    assert suspects.mark("w2", grpc.StatusCode.DEADLINE_EXCEEDED)
    assert not suspects.mark("w3", grpc.StatusCode.RESOURCE_EXHAUSTED)  # full, not gone
    assert not suspects.mark("w4", grpc.StatusCode.INVALID_ARGUMENT)
    assert suspects.current() == {"w1", "w2"}
    suspects.forgive("w2")
    clock.now += 9.9
    assert suspects.current() == {"w1"}
    clock.now += 0.1
    assert suspects.current() == frozenset()
    assert not SuspectList(0.0, clock).mark("w1", grpc.StatusCode.UNAVAILABLE)  # 0 = off
    with pytest.raises(ValueError, match="-1"):
        SuspectList(-1, clock)


def test_snapshot_skips_suspects_unless_their_whole_role_is_suspect():
    clock = Clock()
    view = ClusterView(4, suspect_cooldown_s=10.0, clock=clock)
    workers = {w: WorkerEndpoint(w, f"127.0.0.1:{5000 + i}", role, lease_id=1)
               for i, (w, role) in enumerate([("p0", Role.PREFILL), ("p1", Role.PREFILL), ("d0", Role.DECODE)])}  # fmt: skip
    view.set_workers(workers)
    view.suspects.mark("p0", grpc.StatusCode.UNAVAILABLE)
    view.suspects.mark("d0", grpc.StatusCode.DEADLINE_EXCEEDED)
    snapshot = view.snapshot([], 8)
    assert [w.worker_id for w in snapshot.prefill] == ["p1"]
    assert [w.worker_id for w in snapshot.decode] == ["d0"]  # the only decode worker: still tried
    assert [w.worker_id for w in view.snapshot([], 8, exclude=frozenset({"p1"})).prefill] == ["p0"]
    view.set_workers(workers | {"p0": WorkerEndpoint("p0", "127.0.0.1:5000", Role.PREFILL, lease_id=2)})
    assert sorted(w.worker_id for w in view.snapshot([], 8).prefill) == ["p0", "p1"]  # re-registered: forgiven


async def test_stream_deadlines_first_chunk_and_stall():
    async def stream(delays):
        for i, delay in enumerate(delays):
            await asyncio.sleep(delay)
            yield i

    assert [i async for i in with_deadlines(stream([0, 0.01, 0.01]), "w", 0.5, 0.5)] == [0, 1, 2]
    with pytest.raises(WorkerCallError, match="no first chunk within 0.05 s") as error:
        [i async for i in with_deadlines(stream([1.0]), "w", 0.05, 5)]
    assert error.value.code is grpc.StatusCode.DEADLINE_EXCEEDED and error.value.worker_id == "w"
    got = []
    with pytest.raises(WorkerCallError, match="no chunk within 0.05 s"):
        async for i in with_deadlines(stream([0, 0, 1.0]), "w", 5, 0.05):
            got.append(i)
    assert got == [0, 1]


async def test_decode_worker_silent_after_its_first_chunk_is_retried_by_recompute():
    """It pulled (and released) the handoff before going silent: the retry cannot reuse it."""
    p0, d0, d1 = PrefillDouble("p0"), DecodeDouble("d0"), DecodeDouble("d1")
    d0.hold_after_first = asyncio.Event()  # never set: hung
    async with serving(p0, d0, d1) as endpoints, router(endpoints, decode_stall_timeout_s=0.3) as (_, stub):
        chunks = await collect(stub, request("r1"))
        await eventually(lambda: d0.aborted == ["r1"])
    first = first_token_of(PROMPT)
    (retry,) = d1.requests
    assert not retry.HasField("handoff") and list(retry.token_ids) == PROMPT + [first]
    second = first_token_of(PROMPT + [first])
    assert tokens_of(chunks) == [first] + [second + i for i in range(4)]
    routing = chunks[-1].routing
    assert routing.num_decode_attempts == 2 and "decode on d0 failed (DEADLINE_EXCEEDED)" in routing.reason


async def test_stream_broken_after_tokens_with_no_other_decode_worker_fails_unavailable_with_advice():
    p0, d0 = PrefillDouble("p0"), DecodeDouble("d0")
    d0.hold_after_first, d0.hold_after_index = asyncio.Event(), 2
    async with serving(p0, d0) as endpoints, router(endpoints, decode_stall_timeout_s=0.3) as (_, stub):
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as error:
            async for chunk in stub.Generate(request("r1", num_tokens=8)):
                received += chunk.token_ids
        await eventually(lambda: d0.aborted == ["r1"])
    assert len(received) == 3  # the prefill's token, then two of the decode worker's
    assert len(d0.requests) == 1
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    details = error.value.details()
    assert "no chunk within 0.3 s" in details and "after 3 tokens were sent" in details
    assert "no other decode worker could go on" in details and "retry the request" in details


async def test_stream_with_stop_words_broken_after_tokens_resumes_with_them():
    """The next worker gets the stop words and `output_offset` = the tokens sent, which tells it
    they are output, so it matches stop words across the break (engine/stop.py)."""
    p0, d0, d1 = PrefillDouble("p0"), DecodeDouble("d0"), DecodeDouble("d1")
    for double in (d0, d1):  # whichever gets the handoff hangs after three tokens; a resumed call does not
        double.hold_after_first, double.hold_after_index, double.hold_only_with_handoff = asyncio.Event(), 2, True
    with_stops = request("r1", num_tokens=8)
    with_stops.sampling_params.stop_words.append("<end>")
    async with serving(p0, d0, d1) as endpoints, router(endpoints, decode_stall_timeout_s=0.3) as (_, stub):
        chunks = await collect(stub, with_stops)
        hung, went_on = (d0, d1) if d0.requests[0].HasField("handoff") else (d1, d0)
        await eventually(lambda: hung.aborted == ["r1"])
    (resumed,) = went_on.requests
    first = first_token_of(PROMPT)
    sent = [first, first + 1, first + 2]
    assert list(resumed.token_ids) == PROMPT + sent
    assert list(resumed.sampling_params.stop_words) == ["<end>"] and resumed.sampling_params.output_offset == 3
    assert tokens_of(chunks)[:3] == sent and len(tokens_of(chunks)) == 8


async def test_greedy_stream_broken_after_tokens_resumes_on_another_decode_worker():
    p0, d0, d1 = PrefillDouble("p0"), DecodeDouble("d0"), DecodeDouble("d1")
    for double in (d0, d1):  # whichever gets the handoff hangs after three tokens; a resumed call does not
        double.hold_after_first, double.hold_after_index, double.hold_only_with_handoff = asyncio.Event(), 2, True
    async with serving(p0, d0, d1) as endpoints, router(endpoints, decode_stall_timeout_s=0.3) as (_, stub):
        chunks = await collect(stub, request("r1", num_tokens=8))
        hung, went_on = (d0, d1) if d0.requests[0].HasField("handoff") else (d1, d0)
        await eventually(lambda: hung.aborted == ["r1"])
    (resumed,) = went_on.requests
    first = first_token_of(PROMPT)
    sent = [first, first + 1, first + 2]
    assert not resumed.HasField("handoff") and list(resumed.token_ids) == PROMPT + sent
    assert resumed.sampling_params.num_tokens_to_generate == 5
    after = first_token_of(PROMPT + sent)
    assert tokens_of(chunks) == sent + [after + i for i in range(5)]
    assert chunks[-1].usage.completion_tokens == 8
    assert "resumed after 3 tokens" in chunks[-1].routing.reason and chunks[-1].routing.num_decode_attempts == 2


async def test_sampled_stream_broken_after_tokens_resumes_with_its_positions_counted_on():
    p0, d0, d1 = PrefillDouble("p0"), DecodeDouble("d0"), DecodeDouble("d1")
    for double in (d0, d1):  # whichever gets the handoff hangs after three tokens; a resumed call does not
        double.hold_after_first, double.hold_after_index, double.hold_only_with_handoff = asyncio.Event(), 2, True
    sampled = request("r1", num_tokens=8)
    sampled.sampling_params.temperature, sampled.sampling_params.seed = 0.7, 11
    async with serving(p0, d0, d1) as endpoints, router(endpoints, decode_stall_timeout_s=0.3) as (_, stub):
        chunks = [chunk async for chunk in stub.Generate(sampled)]
        hung, went_on = (d0, d1) if d0.requests[0].HasField("handoff") else (d1, d0)
        await eventually(lambda: hung.aborted == ["r1"])
    (resumed,) = went_on.requests
    params = resumed.sampling_params
    assert not resumed.HasField("handoff") and len(resumed.token_ids) == len(PROMPT) + 3
    assert (params.num_tokens_to_generate, params.output_offset, params.seed, params.temperature) == (
        5, 3, 11, pytest.approx(0.7))  # the seed kept, sampling positions counted on past the 3 sent tokens
    assert sum(len(c.token_ids) for c in chunks) == 8
    assert "resumed after 3 tokens" in chunks[-1].routing.reason
