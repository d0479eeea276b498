"""Log-probs of a step's sampled rows computed on the device, beside the tokens, without a host
sync per row — so a decode step whose requests want log-probs can still run ahead
(engine/step_pipeline.py).

A row qualifies when its token is known on the device at launch — a greedy row (its argmax), a
sampled row drawn by the batched device sampler (engine/device_sampler.py) — and its log-probs are
those of the model's own logits: greedy rows, and sampled rows in `raw_logprobs` mode. A row with
a logit bias or penalties qualifies in a decode step's launch in `raw_logprobs` mode: its raw
log-softmax is taken before the row is adjusted in place for its token (engine/adjusted_rows.py);
elsewhere (a step with prefill chunks) it keeps the host sampler. Sampled rows in
`processed_logprobs` mode (log-probs of the temperature / top-k / top-p logits) keep the host
sampler (engine/sampler.py `sample_row`), and their steps are not run ahead.

For the picked rows, at once: the chosen token's log-prob and the top N (N = the most any row
asks; each row keeps its own first N) — on CUDA two Triton launches over [rows, vocab]
(`kernels.row_logprobs`), in torch elsewhere and where a row's raw log-softmax must be taken
before the row is adjusted — then small copies to pinned host memory that the step's `ready`
event covers.
The same functions serve steps that collect on the spot (prefill chunks), and a plain engine's
decode steps take the launch path too, so a request's log-probs do not depend on whether its
steps ran ahead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve import kernels


def wants_logprobs(params) -> bool:
    return bool(params.return_log_probs or params.top_n_logprobs)


def on_device(params, logprobs_mode: str, adjusted_too: bool = False) -> bool:
    """Log-probs this module computes for a row whose token is known on the device: the model's
    own logits, and for a sampled row only in `raw_logprobs` mode; `adjusted_too` (a decode step's
    launch): also a row with a bias or penalties, in `raw_logprobs` mode."""
    if not wants_logprobs(params) or params.is_guided:  # guided: with its token, on the host
        return False
    if params.adjusts_logits:
        return adjusted_too and logprobs_mode == "raw_logprobs"
    return params.is_greedy or logprobs_mode == "raw_logprobs"


@dataclass(frozen=True)
class StepLogprobs:
    """Log-probs of some chunks of a step, on their way to (or in) host memory."""

    chunks: tuple[int, ...]
    """The chunk indices, in row order of the tensors below."""
    chosen: torch.Tensor
    """[rows] float32: log-prob of each row's token."""
    top_values: torch.Tensor | None
    """[rows, N] float32: the N highest log-probs, descending; None: no row asked for any."""
    top_ids: torch.Tensor | None
    top_n: tuple[int, ...]
    """How many of the top entries each row wants (0: none)."""

    def read(self) -> dict[int, tuple[float, dict[int, float] | None]]:
        """{chunk index: (log-prob, {token: log-prob} of its top-N or None)}; the host copies
        must be complete (the step's `ready` event)."""
        chosen = self.chosen.tolist()
        values = self.top_values.tolist() if self.top_values is not None else None
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        out = {}
        for j, (i, n) in enumerate(zip(self.chunks, self.top_n, strict=True)):
            top = dict(zip(ids[j][:n], values[j][:n], strict=True)) if n else None
            out[i] = (chosen[j], top)
        return out


def log_softmax_rows(logits: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """[len(rows), vocab] float32 log-probs of logits rows `rows` (an index tensor on their
    device; None: every row, in order): one kernel, the host sampler's arithmetic."""
    picked = logits if rows is None else logits.index_select(0, rows)
    return torch.log_softmax(picked.float(), dim=-1)


def compute(
    logits: torch.Tensor, chunks: Sequence[int], rows: torch.Tensor | None, tokens: torch.Tensor,
    top_n: Sequence[int],
) -> StepLogprobs:
    """Log-probs of `tokens` [len(chunks)] (on the logits' device) in logits rows `rows` (an
    index tensor on their device; None: every row, in order) for `chunks`; each row's top
    `top_n[j]`. Queued on the device; on CUDA the results are copied to pinned host memory
    without waiting. On CUDA two Triton launches (`kernels.row_logprobs`; top N <= 20, the
    engine's limit): a batch-1 row that wants log-probs costs its step +0.02 ms on an H200,
    against +0.12 in torch's launches (benchmarks/RESULTS.md, session 30); torch elsewhere."""
    if logits.is_cuda and logits.stride(-1) == 1 and kernels.triton_available():
        index = rows if rows is not None else torch.arange(len(chunks), device=logits.device)
        chosen, values, ids = kernels.row_logprobs(logits, index, tokens.view(-1).to(torch.long), max(top_n, default=0))
        return _pinned(chunks, chosen, values, ids, top_n)
    return finish(log_softmax_rows(logits, rows), chunks, tokens, top_n)


def finish(logprobs: torch.Tensor, chunks: Sequence[int], tokens: torch.Tensor, top_n: Sequence[int]) -> StepLogprobs:
    """`compute` from rows' log-probs already taken (`log_softmax_rows`)."""
    chosen = logprobs.gather(1, tokens.view(-1, 1).to(torch.long)).squeeze(1)
    most = max(top_n, default=0)
    values = ids = None
    if most:
        values, ids = torch.topk(logprobs, most, dim=-1)
    return _pinned(chunks, chosen, values, ids, top_n)


def _pinned(chunks, chosen, values, ids, top_n) -> StepLogprobs:
    if chosen.is_cuda:
        chosen, values, ids = (_to_pinned(t) if t is not None else None for t in (chosen, values, ids))
    return StepLogprobs(tuple(chunks), chosen, values, ids, tuple(top_n))


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
