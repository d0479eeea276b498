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
from tests.fixtures.engine_batch import run_batch  # noqa: E402

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


def test_sampled_guided_rows_drawn_together_follow_the_schema(device, monkeypatch):
    if device.type != "cpu":
        pytest.skip("on a GPU tests/engine/test_guided.py runs this path as served")
    llm = LLM(block_size_tokens=16, num_blocks=256, dtype="float32")
    llm.engine.runner._guided_draws = True
    taken = []
    batched = StepSampling._guided_tokens  # rows taken together (at collect, or settled ahead)
    monkeypatch.setattr(StepSampling, "_guided_tokens", lambda *a: taken.append((r := batched(*a))[0]) or r)
    prompts = ["Give me JSON:", "x", "def f():"]
    params = [SamplingParams(num_tokens_to_generate=40, temperature=t, top_k=k, top_p=p, seed=s, json_schema=json.dumps(SCHEMA))
              for t, k, p, s in ((1.0, 0, 0.0, 1), (0.8, 20, 0.0, 2), (1.2, 0, 0.9, 3))]
    first = [llm.generate([prompt], p)[0] for prompt, p in zip(prompts, params, strict=True)]
    for result in first:
        value = json.loads(result.generated_text)
        assert result.status == "stopped" and set(value) == {"n", "ok"} and isinstance(value["ok"], bool)
    assert sum(len(t) for t in taken) >= sum(len(r.generated_tokens) for r in first)  # every token drawn together
    together, _ = run_batch(llm.engine, list(zip(prompts, params, strict=True)))  # a batch of the three: the same draws
    assert [r.generated_tokens for r in together] == [r.generated_tokens for r in first]


def test_sampled_guided_rows_run_ahead_with_the_plain_engines_draws(device):
    """Where the device sampler draws them, sampled guided rows do not keep their batch from running
    ahead (async scheduling): their tokens are masked and drawn before the next step is launched,
    and are those an engine that never runs ahead draws."""
    if device.type != "cpu":
        pytest.skip("on a GPU tests/engine/test_guided.py runs this path as served")
    schema = json.dumps(SCHEMA)
    rows = [("Give me JSON:", SamplingParams(num_tokens_to_generate=40, temperature=1.0, seed=1, json_schema=schema)),
            ("x", SamplingParams(num_tokens_to_generate=40, temperature=0.8, top_k=20, seed=2, json_schema=schema)),
            ("def f():", SamplingParams(num_tokens_to_generate=20, temperature=0.9, seed=7, ignore_eos=True))]
    runs = []
    for async_scheduling in (False, True):
        engine = LLM(block_size_tokens=16, num_blocks=256, dtype="float32", async_scheduling=async_scheduling).engine
        engine.runner._guided_draws = True
        runs.append(run_batch(engine, rows))
    (plain, never), (got, ahead) = runs
    assert not any(never)
    assert [r.generated_tokens for r in got] == [r.generated_tokens for r in plain]
    for result in got[:2]:
        assert result.status == "stopped" and set(json.loads(result.generated_text)) == {"n", "ok"}
    running = min(len(r.generated_tokens) for r in got[:2])
    assert sum(ahead[: running - 1]) >= running - 3, ahead
