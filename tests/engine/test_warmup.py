"""Warm-up (engine/warmup.py): dummy requests run at each batch size, decode steps of exactly that
many rows, and nothing of them stays — no block in use, no cached prefix, no pin, no KV event —
so the engine then answers exactly as a fresh one."""

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.warmup import LOGIT_ROWS, compile_logit_rows, warm_up
from splitserve.kernels.linear import MAX_ROWS, row_variant

OPTIONS = dict(block_size_tokens=4, num_blocks=96, max_tokens=32, max_requests=8)
PARAMS = SamplingParams(num_tokens_to_generate=8, temperature=0.0, ignore_eos=True, return_log_probs=True)


def _rows_per_step(engine):
    """Wraps engine.step: the number of requests running at each step."""
    rows, step = [], engine.step

    def counting_step():
        rows.append(len(engine.scheduler.running))
        return step()

    engine.step = counting_step
    return rows


@pytest.mark.parametrize("role", ["aggregated", "prefill", "decode"])
def test_warm_up_leaves_nothing_behind(llama_ckpt, role):
    engine = LLM(str(llama_ckpt), role=role, **OPTIONS).engine
    engine.pool.record_events = True  # as a worker with a KV-event publisher has it
    rows = _rows_per_step(engine)
    report = warm_up(engine, batches=(1, 2, 4))
    assert report.batches == (1, 2, 4) and report.num_requests == 7
    if role != "prefill":  # a prefill engine stops each request at its first token: no decode rows
        assert {1, 2, 4} <= set(rows), rows  # decode steps of exactly each batch size ran
    stats = engine.pool.stats()
    assert stats.num_in_use == 0 and stats.num_pinned == 0 and engine.pool.cached_hashes() == []
    assert engine.pool.drain_events() == [] and engine.pool.record_events is True
    assert not engine.handoffs and not engine.has_unfinished()
    engine.check_integrity()


def test_after_warm_up_the_engine_answers_as_a_fresh_one(llama_ckpt):
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 18, 9)]
    fresh = LLM(str(llama_ckpt), **OPTIONS).generate(prompts, PARAMS)
    warmed = LLM(str(llama_ckpt), **OPTIONS)
    warm_up(warmed.engine)
    again = warmed.generate(prompts, PARAMS)
    for a, b in zip(fresh, again, strict=True):
        assert a.generated_tokens == b.generated_tokens
        assert a.generated_log_probs == pytest.approx(b.generated_log_probs, abs=1e-6)
        assert b.num_cached_tokens == 0  # no prefix left by the dummies


def test_warm_up_runs_the_logit_adjustment_with_and_without_a_fed_token(llama_ckpt, monkeypatch):
    """Both compiled forms of the adjustment kernel (kernels/logit_adjust.py: a step launched ahead
    feeds the previous token; a prefill's collect does not) run before the first client's."""
    from splitserve.engine import logit_slots

    fed, apply = [], logit_slots.apply
    monkeypatch.setattr(logit_slots, "apply", lambda *args: fed.append(args[5] is not None) or apply(*args))
    warm_up(LLM(str(llama_ckpt), async_scheduling=True, **OPTIONS).engine, batches=(1, 2))
    assert True in fed and False in fed


def test_with_async_scheduling_no_dummy_output_reaches_the_first_real_step(llama_ckpt):
    """A step run ahead of the dummies' last tokens is collected by the warm-up itself: the first
    real step must not hand a dummy's output to the worker's callbacks (a prefill worker looks up
    each handoff output's pins)."""
    engine = LLM(str(llama_ckpt), async_scheduling=True, **OPTIONS).engine
    warm_up(engine, batches=(1, 2, 4))
    assert engine.step() == []
    engine.check_integrity()


def test_batches_past_the_engine_s_limits_are_skipped_and_a_busy_engine_refused(llama_ckpt):
    engine = LLM(str(llama_ckpt), **{**OPTIONS, "max_requests": 2}).engine
    assert warm_up(engine, batches=(1, 2, 4, 8)).batches == (1, 2)  # 4 and 8 never run at max_requests 2
    engine.add_request("real", [5, 6, 7], PARAMS)
    with pytest.raises(ValueError, match="idle engine"):
        warm_up(engine)


def test_the_lm_head_runs_at_the_row_counts_the_rounds_miss(llama_ckpt):
    """(On a GPU: its kernel variants compiled before serving.) Each of LOGIT_ROWS, once, and
    they reach every variant any row count the kernel takes compiles."""
    engine = LLM(str(llama_ckpt), **OPTIONS).engine
    seen, model = [], engine.runner.model
    plain, with_argmax = model.compute_logits, model.logits_and_argmax
    model.compute_logits = lambda hidden: seen.append(("plain", hidden.shape[0])) or plain(hidden)
    model.logits_and_argmax = lambda hidden, keep_rows=None: seen.append(("argmax", hidden.shape[0])) or with_argmax(hidden)
    # both forms: chunks that end a prompt take plain logits, decode steps the epilogue's argmax
    assert compile_logit_rows(engine) == len(LOGIT_ROWS)
    assert seen == [(form, rows) for rows in LOGIT_ROWS for form in ("plain", "argmax")]
    every = {row_variant(rows) for rows in range(1, MAX_ROWS + 1)}
    assert {row_variant(rows) for rows in LOGIT_ROWS} == every and len(LOGIT_ROWS) == len(every) == 7


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_on_a_gpu_every_decode_graph_bucket_is_captured_before_serving(tmp_path):
    """The point of the warm-up: the first real step of each batch bucket replays a graph captured
    before it (no capture in a client's step), and the dummies leave nothing in the pool."""
    from tests.fixtures.models import build_hf_checkpoint

    build_hf_checkpoint(tmp_path, "llama")
    llm = LLM(str(tmp_path), device="cuda", enable_cuda_graphs=True, block_size_tokens=16, num_blocks=256,
              max_tokens=256, max_requests=8)
    engine = llm.engine
    graphs = engine.runner.graphs
    report = warm_up(engine)
    assert report.batches == tuple(graphs.buckets) and report.long_prompt
    assert {bucket for bucket, _ in graphs._static} == set(graphs.buckets)
    assert report.mixed_graphs > 0 and warm_up(engine).mixed_graphs == 0  # all of them, once
    captured, mixed = set(graphs._static), set(graphs.mixed._static)
    stats = engine.pool.stats()
    assert stats.num_in_use == 0 and stats.num_pinned == 0 and engine.pool.cached_hashes() == []
    prompts = [list(range(3 + i, 40 + i)) for i in range(5)]
    llm.generate(prompts, PARAMS)
    assert set(graphs._static) == captured  # the real batch (5 -> bucket 8) captured nothing new
    assert set(graphs.mixed._static) == mixed  # nor did its prefill step
    engine.check_integrity()
