"""Sampling: greedy, temperature, top-k, top-p with per-request seeded generators,
and log-probs (raw or processed) of chosen, prompt and top-N tokens.

Logits arrive as float32 [N, vocab]; one row per sampled request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve.engine.logit_slots import adjust_once
from splitserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SampleResult:
    token_id: int
    logprob: float | None = None
    top_n: dict[int, float] | None = None


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row [vocab] -> logits after temperature, top-k and top-p (masked to -inf)."""
    x = logits / params.temperature if params.temperature > 0 else logits.clone()
    if params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if 0.0 < params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the mass before it already reaches top_p; the first always stays.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop[0] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return x


def sample_row(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    logprobs_mode: str,
    output_ids: Sequence[int] = (),
    preadjusted: bool = False,
    token_only: bool = False,
    allowed: torch.Tensor | None = None,
) -> SampleResult:
    """logits [vocab] float32 -> the next token (and its log-probs when asked); `output_ids`:
    the request's output so far, for its penalties (engine/logit_slots.py `adjust_once`); `preadjusted`: the row's
    adjustments are already in `logits` (engine/adjusted_rows.py); `token_only`: no log-probs
    (their caller takes them elsewhere: engine/step_logprobs.py); `allowed`: bool [vocab], the
    only tokens that may be sampled (engine/guided.py)."""
    adjust = params.adjusts_logits and not preadjusted
    scored = adjust_once(logits, params, output_ids) if adjust else logits
    if allowed is not None:  # a guided row (engine/guided.py): only tokens that keep its grammar
        scored = scored.masked_fill(~allowed.to(scored.device), float("-inf"))
    if params.is_greedy:
        token = int(torch.argmax(scored))
        processed = scored if scored is not logits else None
    else:
        processed = process_logits(scored, params)
        probs = torch.softmax(processed, dim=-1)
        token = int(torch.multinomial(probs, 1, generator=generator))
    if token_only or (not params.return_log_probs and not params.top_n_logprobs):
        return SampleResult(token)
    basis = processed if (logprobs_mode == "processed_logprobs" and processed is not None) else logits
    logprobs = torch.log_softmax(basis, dim=-1)
    top_n = None
    if params.top_n_logprobs:
        values, ids = torch.topk(logprobs, params.top_n_logprobs)
        top_n = {int(i): float(v) for i, v in zip(ids.tolist(), values.tolist(), strict=True)}
    return SampleResult(token, float(logprobs[token]), top_n)


def prompt_logprobs(
    logits: torch.Tensor, next_token_ids: list[int], top_n: int = 0
) -> tuple[list[float], list[dict[int, float]]]:
    """logits [n, vocab] at positions p..p+n-1 and the tokens at p+1..p+n -> their log-probs, and
    (top_n > 0) each position's top_n alternatives as {token id: log-prob} (else an empty list)."""
    if not next_token_ids:
        return [], []
    logprobs = torch.log_softmax(logits[: len(next_token_ids)].float(), dim=-1)
    ids = torch.tensor(next_token_ids, device=logits.device)
    chosen = logprobs.gather(1, ids[:, None]).squeeze(1).tolist()
    if not top_n:
        return chosen, []
    values, top_ids = torch.topk(logprobs, min(top_n, logprobs.shape[-1]))
    tops = [dict(zip(i, v, strict=True)) for i, v in zip(top_ids.tolist(), values.tolist(), strict=True)]
    return chosen, tops


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator
