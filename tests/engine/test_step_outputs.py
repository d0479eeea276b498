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
