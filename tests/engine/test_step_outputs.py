"""Step outputs without snapshots (`Engine.snapshot_outputs` off, as decode workers run): only
a request's first token and its end carry a whole result, and the per-step additions add up
to that final result — tokens, log-probs and top-n log-probs — with async scheduling too."""

import pytest

from splitserve import LLM, SamplingParams


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["plain", "async"])
def test_step_additions_add_up_to_the_final_result(llama_ckpt, async_scheduling):
    llm = LLM(str(llama_ckpt), device="cpu", block_size_tokens=4, num_blocks=96, max_tokens=64,
              async_scheduling=async_scheduling)  # fmt: skip
    engine = llm.engine
    engine.snapshot_outputs = False
    params = [
        SamplingParams(num_tokens_to_generate=9, temperature=0.0, ignore_eos=True, return_log_probs=True,
                       top_n_logprobs=3),  # fmt: skip
        SamplingParams(num_tokens_to_generate=5, temperature=0.0, ignore_eos=True),
        SamplingParams(num_tokens_to_generate=1, temperature=0.0, ignore_eos=True, return_log_probs=True),
    ]
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", [5 + i, 17, 33, 2 + i], p)
    seen = {f"r{i}": dict(tokens=[], log_probs=[], top_n=[], counts=[], snapshots=[]) for i in range(len(params))}
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            s = seen[out.request_id]
            s["tokens"] += out.new_token_ids
            s["log_probs"] += out.new_log_probs
            s["top_n"] += out.new_top_n
            s["counts"].append(out.num_generated)
            s["snapshots"].append(out.result is not None)
            if out.result is not None and out.result.is_finished:
                final[out.request_id] = out.result
    engine.check_integrity()
    for rid, s in seen.items():
        res = final[rid]
        n = len(res.generated_tokens)
        assert s["tokens"] == res.generated_tokens
        assert s["counts"] == list(range(1, n + 1))
        assert s["snapshots"] == [i in (0, n - 1) for i in range(n)]  # the first token and the end
        assert s["log_probs"] == (res.generated_log_probs or [])
        assert s["top_n"] == (res.top_n_logprobs or [])
    assert len(seen["r0"]["top_n"]) == 9 and all(len(t) == 3 for t in seen["r0"]["top_n"])
    assert len(seen["r2"]["log_probs"]) == 1 and seen["r1"]["log_probs"] == []


def test_a_steps_outputs_reach_their_streams_with_one_wakeup_per_event_loop():
    """decode_worker/hooks.py: `DecodeState.deliver` hands a step's outputs to the asyncio
    queues of their streams in order, skipping requests without a stream, and wakes each
    event loop once a step (a wake-up per output cost the engine thread ~0.2 ms at batch 64)."""
    import asyncio
    import threading

    from splitserve.decode_worker.hooks import DecodeState
    from splitserve.engine.step_outputs import StepOutput

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    wakeups = []
    original = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *a: (wakeups.append(a), original(*a))[1]
    try:
        state = DecodeState()
        queues = {rid: asyncio.Queue() for rid in ("a", "b")}
        state.streams.update({rid: (loop, q) for rid, q in queues.items()})
        outs = [StepOutput(rid, (i,), "", None, 1) for i, rid in enumerate(["a", "gone", "b", "a"])]
        state.deliver(outs)
        state.deliver([])
        assert len(wakeups) == 1

        async def drain():
            return {rid: [q.get_nowait().new_token_ids[0] for _ in range(q.qsize())] for rid, q in queues.items()}

        got = asyncio.run_coroutine_threadsafe(drain(), loop).result(timeout=10)
        assert got == {"a": [0, 3], "b": [2]}
    finally:
        loop.call_soon_threadsafe = original
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def test_a_closed_event_loop_does_not_cost_other_loops_their_outputs():
    """`DecodeState.deliver`: a stream whose event loop has closed (its server shut down)
    drops its outputs; the streams of other loops still get theirs, in order."""
    import asyncio
    import threading

    from splitserve.decode_worker.hooks import DecodeState
    from splitserve.engine.step_outputs import StepOutput

    closed = asyncio.new_event_loop()
    closed.close()
    live = asyncio.new_event_loop()
    thread = threading.Thread(target=live.run_forever, daemon=True)
    thread.start()
    try:
        state = DecodeState()
        queue = asyncio.Queue()
        state.streams.update({"dead": (closed, asyncio.Queue()), "alive": (live, queue)})
        state.deliver([StepOutput(rid, (i,), "", None, 1) for i, rid in enumerate(["dead", "alive", "alive"])])

        async def drain():
            return [queue.get_nowait().new_token_ids[0] for _ in range(queue.qsize())]

        assert asyncio.run_coroutine_threadsafe(drain(), live).result(timeout=10) == [1, 2]
    finally:
        live.call_soon_threadsafe(live.stop)
        thread.join(timeout=10)
        live.close()
