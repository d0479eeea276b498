"""Warm-up: run dummy requests through an engine's own step path before it serves.

A fresh engine pays one-time costs on the first requests that reach it: on a GPU, Triton
compiles each kernel specialization (seconds on a host without a kernel cache) and a CUDA
graph is captured for each decode batch-size bucket the first time a step of that size runs
(`cuda_graphs.py`), stalling every request of that step; on a CPU, the allocator's and the
thread pool's first use (the first prompt's prefill measured 12.9 ms against 7.6 ms once warm,
its first decode step 7.8 against 5.0 ms, embedded model). `warm_up` moves them before the
worker registers, so no client waits for them:

    for each batch size b of the decode graph buckets (CPU: 1 and 2):
        b requests (greedy and seeded-sampled alternately; short distinct prompts; the first
            of all with a penalty and a bias: the logit-adjustment kernel, with and without a
            fed token)
        stepped to the end: prefill steps, then decode steps of exactly b rows
    GPU: one prompt longer than a step's token budget (a full chunk, then a chunk over its
        cached prefix: the eager prefill's kernels at their largest shapes)
    GPU, aggregated: every mixed-step graph of the narrowest context (`MixedGraphs`)
    GPU: the LM head at a row count of each of its kernel variants (`LOGIT_ROWS`)
    then every trace removed: handoff pins released, the prefix cache emptied, no KV event

It runs as an engine command (`EngineLoop` handler "warm_up"): every rank of a TP x PP group
applies it in lockstep, as it applies requests, so the group's collectives stay matched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from splitserve.engine.sampling_params import SamplingParams
from splitserve.kernels.linear import rows_per_variant

CPU_BATCHES = (1, 2)
"""CPU engines run no graphs: two small rounds warm the prefill and the batched decode path."""


@dataclass(frozen=True)
class WarmUpReport:
    batches: tuple[int, ...]
    """The batch sizes run (each capped by the engine's request and block limits)."""
    num_requests: int
    seconds: float
    long_prompt: bool = False
    """Whether a prompt longer than a step's token budget ran (GPU: the chunked, eager prefill)."""
    mixed_graphs: int = 0
    """Mixed-step graphs captured up front (GPU, aggregated: `MixedGraphs.capture_narrowest`)."""


def warm_up(engine, batches: tuple[int, ...] | None = None) -> WarmUpReport:
    """Run the warm-up on an idle engine (ValueError if it holds requests: their blocks and
    cached prefixes would be mixed with the dummies'). `batches` None: the decode graph
    buckets on a GPU engine, `CPU_BATCHES` otherwise."""
    if engine.has_unfinished() or engine.handoffs or engine.reserved:
        raise ValueError("warm-up needs an idle engine (run it before the engine serves)")
    started = time.perf_counter()
    graphs = getattr(engine.runner, "graphs", None)
    if batches is None:
        batches = tuple(graphs.buckets) if graphs is not None else CPU_BATCHES
    scheduler = engine.config.scheduler
    prompt_len = min(engine.block_size + 1, engine.max_sequence_length // 2)
    records = engine.pool.record_events
    engine.pool.record_events = False  # nothing of the dummies reaches a router's prefix index
    ran: list[int] = []
    ids: list[str] = []
    try:
        for batch in sorted(set(batches)):
            # Enough new tokens that the first prompts still decode when the last is prefilled:
            # the last steps then decode exactly `batch` rows (that bucket's graph).
            new_tokens = min(-(-batch * prompt_len // scheduler.max_tokens) + 2, engine.max_sequence_length - prompt_len)
            blocks = batch * -(-(prompt_len + new_tokens) // engine.block_size)
            if batch < 1 or batch > scheduler.max_requests or 2 * blocks > engine.pool.num_blocks:
                continue  # past the engine's limits: no step of this size will run
            ids += [_add(engine, sum(ran) + i, prompt_len, new_tokens) for i in range(batch)]
            ran.append(batch)
            _run(engine)
        long_len = scheduler.max_tokens + engine.block_size + 1
        on_gpu = engine.runner.device.type == "cuda"  # Triton compiles: with or without CUDA graphs
        long_prompt = (on_gpu and scheduler.enable_chunked_prefill
                       and long_len + 2 <= engine.max_sequence_length
                       and 2 * -(-(long_len + 2) // engine.block_size) <= engine.pool.num_blocks)
        if long_prompt:  # a chunk past the budget, then one over its cached prefix: eager steps' kernels
            ids.append(_add(engine, sum(ran), long_len, 2))
            _run(engine)
        mixed = graphs.mixed.capture_narrowest() if graphs is not None and graphs.mixed is not None else 0
        if on_gpu:
            compile_logit_rows(engine)
    finally:
        for request_id in ids:  # a prefill engine pins each handoff (nobody will pull these); a
            engine.abort(request_id)  # failed step leaves requests running: gone either way
        engine.pool.reset_prefix_cache()
        if getattr(engine.runner, "states", None) is not None:
            engine.runner.states.reset_prefix_cache()
        engine.pool.drain_events()
        engine.pool.record_events = records
    return WarmUpReport(tuple(ran), sum(ran), time.perf_counter() - started, long_prompt, mixed)


LOGIT_ROWS = rows_per_variant()
"""Row counts for the eager logits (one row per chunk that ends in a step: any count up to the
batch): one of each compiled variant of the LM-head kernel (kernels/linear.py: per row tile of
16 / 32 / 64 and per whether the count is 1, a multiple of 16 or neither), so that no count
compiles in a served step. Without them a warm engine's first step ending 51 prompts compiled
for 0.32-0.45 s (H200 / H100, benchmarks/RESULTS.md, sessions 25-26; session 25's hand-picked
3, 24, 48 missed the 33-63 row form). Row counts stay specialized: unspecialized, the batch-1
decode step ran ~5% slower on the H200."""


@torch.inference_mode()
def compile_logit_rows(engine) -> int:
    """Logits of zero hidden states at each of `LOGIT_ROWS` (the last pipeline stage; every TP
    rank of it, in step, as warm-up runs); returns how many ran."""
    runner = engine.runner
    if not runner.ps.is_last_stage:
        return 0
    hidden = torch.zeros(max(LOGIT_ROWS), engine.model_config.hidden_size, dtype=runner.dtype, device=runner.device)
    for rows in LOGIT_ROWS:  # prefill chunks' logits, and decode steps' with their argmax
        runner.model.compute_logits(hidden[:rows])
        runner.model.logits_and_argmax(hidden[:rows])
    return len(LOGIT_ROWS)


def _run(engine) -> None:
    while engine.has_unfinished():
        engine.step()
    engine.flush()  # (nothing is left in flight once no request is: step_pipeline.can_run_ahead)


def _add(engine, i: int, prompt_len: int, new_tokens: int) -> str:
    """Prompt i: distinct token ids (no prefix hits between dummies), odd ones sampled with a seed
    (the sampler's graphs and kernels), even ones greedy; the first also penalized and biased
    (engine/adjusted_rows.py: adjusted at a prefill's collect and at decode launches)."""
    vocab = engine.model_config.vocab_size
    prompt = [(i * 7919 + 13 * j + 1) % vocab for j in range(prompt_len)]
    sampled = {"temperature": 1.0, "top_p": 0.9, "seed": i} if i % 2 else {"temperature": 0.0}
    adjusted = {"frequency_penalty": 0.5, "logit_bias": {1: 0.5}} if i == 0 else {}
    params = SamplingParams(num_tokens_to_generate=new_tokens, ignore_eos=True, **sampled, **adjusted)
    request_id = f"warm-up-{i}"
    engine.add_request(request_id, prompt, params)
    return request_id
