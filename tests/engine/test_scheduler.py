"""Scheduler state, step by step, without a model: the test plays the engine."""

from splitserve.engine.block_pool import BlockPool
from splitserve.engine.config import SchedulerConfig
from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import Scheduler

PARAMS = SamplingParams(num_tokens_to_generate=8, temperature=0.0)


def _req(rid, n, start=0):
    return Request(rid, list(range(start, start + n)), PARAMS, (), 8)


def _run(sched: Scheduler, next_token=7):
    """One step: schedule, then record what the engine would (tokens sampled)."""
    out = sched.schedule()
    for c in out.chunks:
        sched.update_computed(c.request, c.start + c.num_tokens)
        if c.is_sample:
            c.request.output_token_ids.append(next_token)
    return [(c.request.request_id, c.start, c.num_tokens, c.is_sample) for c in out.chunks], out


def test_chunked_prefill_piggybacks_on_decodes():
    pool = BlockPool(32)
    sched = Scheduler(SchedulerConfig(max_tokens=8), pool, block_size=4)
    sched.add(_req("a", 3))
    assert _run(sched)[0] == [("a", 0, 3, True)]
    sched.add(_req("b", 20, start=100))
    # a decodes first (1 token), b gets the other 7 of the budget.
    assert _run(sched)[0] == [("a", 3, 1, True), ("b", 0, 7, False)]
    assert _run(sched)[0] == [("a", 4, 1, True), ("b", 7, 7, False)]
    assert _run(sched)[0] == [("a", 5, 1, True), ("b", 14, 6, True)]
    b = sched.running[1]
    assert b.num_computed_tokens == 20 and len(b.block_ids) == 5
    assert b.num_registered_blocks == 5  # all five full blocks are now cached
    assert pool.stats().num_in_use == 2 + 5


def test_without_chunking_a_long_prompt_waits_for_a_step_of_its_own():
    sched = Scheduler(SchedulerConfig(max_tokens=8, enable_chunked_prefill=False), BlockPool(32), 4)
    sched.add(_req("a", 3))
    _run(sched)
    sched.add(_req("b", 20, start=100))
    assert _run(sched)[0] == [("a", 3, 1, True)]  # b does not fit beside a decode
    sched.running[0].status = RequestStatus.FINISHED_STOPPED
    sched.finish(sched.running[0], RequestStatus.FINISHED_STOPPED)
    assert _run(sched)[0] == [("b", 0, 20, True)]  # alone, it may exceed the budget


def test_prefix_cache_hit_skips_blocks_but_recomputes_the_last_token():
    pool = BlockPool(16)
    sched = Scheduler(SchedulerConfig(max_tokens=64), pool, 4)
    sched.add(_req("a", 8))
    _run(sched)
    a = sched.running[0]
    sched.finish(a, RequestStatus.FINISHED_STOPPED)
    assert pool.stats().num_cached == 2
    sched.add(_req("b", 8))  # same 8 tokens: 2 full blocks cached
    steps, out = _run(sched)
    # Only block 0 may be reused: the last token must be computed for its logits.
    assert steps == [("b", 4, 4, True)]
    b = out.chunks[0].request
    assert b.num_cached_tokens == 4 and b.block_ids[0] == a_block0(pool, a)
    sched.add(_req("c", 10))
    steps, _ = _run(sched)
    assert ("c", 8, 2, True) in steps  # both full blocks reused
    pool.check_integrity()


def a_block0(pool, a):
    return pool.lookup(a.block_hashes[:1])[0]


def test_decode_preempts_the_newest_request_when_the_pool_is_short():
    pool = BlockPool(3)
    sched = Scheduler(SchedulerConfig(max_tokens=64), pool, 4)
    sched.add(_req("a", 3))
    sched.add(_req("b", 3, start=50))
    _run(sched)  # a and b: one block each, 4 tokens known
    sched.add(_req("c", 3, start=90))
    assert _run(sched)[0] == [("a", 3, 1, True), ("b", 3, 1, True), ("c", 0, 3, True)]
    assert pool.num_available == 0
    steps, out = _run(sched)
    # a needs a second block: c (newest) is preempted; then b needs one and only
    # b itself is left to preempt. Both requeue at the front, b first.
    assert steps == [("a", 4, 1, True)]
    assert out.preempted_ids == ("c", "b")
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert all(r.num_computed_tokens == 0 and not r.block_ids for r in sched.waiting)
    assert sched.waiting[0].num_preemptions == 1
    pool.check_integrity()
    assert pool.stats().num_in_use == 2


def test_abort_frees_everything():
    pool = BlockPool(8)
    sched = Scheduler(SchedulerConfig(max_tokens=4), pool, 4)
    sched.add(_req("a", 10))
    _run(sched)
    assert sched.abort("a").status is RequestStatus.FINISHED_ABORTED
    assert sched.abort("zzz") is None
    assert pool.stats().num_in_use == 0 and sched.num_unfinished == 0
    pool.check_integrity()


def test_max_requests_bounds_admission():
    sched = Scheduler(SchedulerConfig(max_tokens=64, max_requests=2), BlockPool(32), 4)
    for i in range(3):
        sched.add(_req(f"r{i}", 3, start=10 * i))
    steps, _ = _run(sched)
    assert [s[0] for s in steps] == ["r0", "r1"] and len(sched.waiting) == 1
