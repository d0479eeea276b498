"""Sampling: greedy, temperature, top-k, top-p with per-request seeded generators,
and log-probs (raw or processed) of chosen, prompt and top-N tokens.

Logits arrive as float32 [N, vocab]; one row per sampled request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SampleResult:
    token_id: int
    logprob: float | None = None
    top_n: dict[int, float] | None = None


def adjust_logits(logits: torch.Tensor, params: SamplingParams, output_ids: Sequence[int]) -> torch.Tensor:
    """One row [vocab] float32 -> a new row with `params`' logit bias added and its presence /
    frequency penalties subtracted for the tokens of `output_ids` (the output so far), as
    OpenAI defines them (`apply_adjustments`). Log-probs stay those of the model's own logits
    ("raw") unless the engine reports processed ones."""
    counts = output_counts([output_ids], logits.shape[-1], logits.device)
    return apply_adjustments(logits[None], counts, [params])[0]


def output_counts(outputs: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(outputs), vocab] float32: how often each token occurs in each row's output (negative
    ids — run-ahead placeholders, engine/step_pipeline.py — are not counted). The ids reach a GPU
    from pinned memory without waiting for the stream (steps may be queued on it)."""
    counts = torch.zeros(len(outputs), vocab, dtype=torch.float32, device=device)
    pairs = [(row, t) for row, ids in enumerate(outputs) for t in ids if t >= 0]
    if pairs:
        index = to_device(pairs, torch.long, device)
        counts.index_put_((index[:, 0], index[:, 1]), torch.ones(len(pairs), device=device), accumulate=True)
    return counts


def apply_adjustments(logits: torch.Tensor, counts: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Rows [k, vocab] float32 -> new rows: logit[j] - (frequency * count[j] + presence * [count[j] > 0]),
    then each row's logit bias added. One form for every path (a row adjusted alone on the host,
    rows adjusted together at a step's launch), so the same row gives the same bits either way."""
    floats = to_device([[p.frequency_penalty, p.presence_penalty] for p in params], torch.float32, logits.device)
    x = logits - (floats[:, :1] * counts + floats[:, 1:] * (counts > 0).to(logits.dtype))
    bias = [(row, t, b) for row, p in enumerate(params) for t, b in p.logit_bias]
    if bias:
        index = to_device([[row, t] for row, t, _ in bias], torch.long, logits.device)
        values = to_device([b for _, _, b in bias], torch.float32, logits.device)
        x.index_put_((index[:, 0], index[:, 1]), values, accumulate=True)
    return x


def to_device(rows: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device`; to a GPU from pinned memory, queued on the stream (a copy
    from pageable memory would wait for the steps already queued there)."""
    host = torch.tensor(rows, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


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
) -> SampleResult:
    """logits [vocab] float32 -> the next token (and its log-probs when asked); `output_ids`:
    the request's output so far, for its penalties (`adjust_logits`); `preadjusted`: the row's
    adjustments are already in `logits` (engine/adjusted_rows.py)."""
    adjust = params.adjusts_logits and not preadjusted
    scored = adjust_logits(logits, params, output_ids) if adjust else logits
    if params.is_greedy:
        token = int(torch.argmax(scored))
        processed = scored if scored is not logits else None
    else:
        processed = process_logits(scored, params)
        probs = torch.softmax(processed, dim=-1)
        token = int(torch.multinomial(probs, 1, generator=generator))
    if not params.return_log_probs and not params.top_n_logprobs:
        return SampleResult(token)
    basis = processed if (logprobs_mode == "processed_logprobs" and processed is not None) else logits
    logprobs = torch.log_softmax(basis, dim=-1)
    top_n = None
    if params.top_n_logprobs:
        values, ids = torch.topk(logprobs, params.top_n_logprobs)
        top_n = {int(i): float(v) for i, v in zip(ids.tolist(), values.tolist(), strict=True)}
    return SampleResult(token, float(logprobs[token]), top_n)


def prompt_logprobs(logits: torch.Tensor, next_token_ids: list[int]) -> list[float]:
    """logits [n, vocab] at positions p..p+n-1 and the tokens at p+1..p+n -> their log-probs."""
    if not next_token_ids:
        return []
    logprobs = torch.log_softmax(logits[: len(next_token_ids)], dim=-1)
    ids = torch.tensor(next_token_ids, device=logits.device)
    return logprobs.gather(1, ids[:, None]).squeeze(1).tolist()


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator
