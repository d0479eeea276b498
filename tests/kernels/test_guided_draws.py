"""Sampled guided rows drawn by the batched device sampler (engine/step_sampling.py
`_guided_batch`): masked in place, then drawn with the other rows in one call. The path runs on
CUDA; here the runner is told to take it on CPU, the sampler's Triton kernel run by the
interpreter, so the whole path — mask, in-place write, draw by row — is exercised off a GPU."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")
pytest.importorskip("llguidance")

from splitserve import LLM, SamplingParams  # noqa: E402
from splitserve.engine.step_sampling import StepSampling  # noqa: E402

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


def test_sampled_guided_rows_drawn_together_follow_the_schema(device, monkeypatch):
    if device.type != "cpu":
        pytest.skip("on a GPU tests/engine/test_guided.py runs this path as served")
    llm = LLM(block_size_tokens=16, num_blocks=256, dtype="float32")
    llm.engine.runner._guided_draws = True
    taken = []
    batched = StepSampling._guided_batch
    monkeypatch.setattr(StepSampling, "_guided_batch", lambda *a: taken.append(r := batched(*a)) or r)
    prompts = ["Give me JSON:", "x", "def f():"]
    params = [SamplingParams(num_tokens_to_generate=40, temperature=t, top_k=k, top_p=p, seed=s, json_schema=json.dumps(SCHEMA))
              for t, k, p, s in ((1.0, 0, 0.0, 1), (0.8, 20, 0.0, 2), (1.2, 0, 0.9, 3))]
    first = [llm.generate([prompt], p)[0] for prompt, p in zip(prompts, params, strict=True)]
    for result in first:
        value = json.loads(result.generated_text)
        assert result.status == "stopped" and set(value) == {"n", "ok"} and isinstance(value["ok"], bool)
    assert sum(len(t) for t in taken) >= sum(len(r.generated_tokens) for r in first)  # every token drawn together
    again = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):  # a batch of the three: the same draws
        again.add_request(f"r{i}", again.tokenizer.encode(prompt), p)
    done = {}
    while again.has_unfinished():
        for out in again.step():
            if out.result is not None and out.result.is_finished:
                done[out.request_id] = out.result
    assert [done[f"r{i}"].generated_tokens for i in range(3)] == [r.generated_tokens for r in first]
    again.check_integrity()
