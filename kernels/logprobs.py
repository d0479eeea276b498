"""Log-probs of some rows of a step's logits in two launches: each row's log-sum-exp, its chosen
token's log-prob and its top N entries.

    logits [B, V] f32, rows contiguous   rows [R] int64: which logits rows
    tokens [R] int64                     -> chosen [R] f32, top values [R, N] f32, top ids [R, N] int64

Grid (rows, vocabulary parts of `_PART`): a program reads its part of a row once into registers
and keeps the part's maximum, its sum of exp(x - maximum) and its top N (N rounds of "maximum,
first index of it, mask it off"); a second launch, one program a row, merges the parts:
lse = M + log(sum_p s_p * exp(m_p - M)), chosen = x[token] - lse, and the top N of the parts'
candidates minus lse. Ties go to the lowest token id. The torch form (engine/step_logprobs.py:
log_softmax, gather, topk) took a handful of launches whose fixed costs a batch-1 decode step
paid each step (~0.13 ms on an H100, benchmarks/RESULTS.md session 28).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, next_power_of_2
from ._launch import FastLaunch

__all__ = ["MAX_TOP", "row_logprobs"]

MAX_TOP = 32
"""Most top entries a row may ask for (the engine allows 20)."""
_PART = 8192  # vocabulary entries a program reads: a 128k row spread over 16 multiprocessors


@triton.jit
def _parts_kernel(logits_ptr, stride_logits, rows_ptr, stats_ptr, cand_val_ptr, cand_idx_ptr, vocab, num_parts,
                  TOP: tl.constexpr, PART: tl.constexpr):
    r = tl.program_id(0)
    part = tl.program_id(1)
    row = tl.load(rows_ptr + r)
    offs = part * PART + tl.arange(0, PART)
    x = tl.load(logits_ptr + row * stride_logits + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    s = tl.sum(tl.where(offs < vocab, tl.exp(x - m), 0.0), axis=0)
    at = (r * num_parts + part) * 2
    tl.store(stats_ptr + at, m)
    tl.store(stats_ptr + at + 1, s)
    base = (r * num_parts + part) * TOP
    for j in tl.static_range(TOP):
        v = tl.max(x, axis=0)
        i = tl.min(tl.where(x == v, offs, 2147483647), axis=0)
        tl.store(cand_val_ptr + base + j, v)
        tl.store(cand_idx_ptr + base + j, i)
        x = tl.where(offs == i, float("-inf"), x)


@triton.jit
def _merge_kernel(logits_ptr, stride_logits, rows_ptr, tokens_ptr, stats_ptr, cand_val_ptr, cand_idx_ptr, chosen_ptr,
                  top_val_ptr, top_idx_ptr, num_parts, TOP: tl.constexpr, BLOCK_P: tl.constexpr,
                  BLOCK_C: tl.constexpr):
    r = tl.program_id(0)
    p = tl.arange(0, BLOCK_P)
    m = tl.load(stats_ptr + (r * num_parts + p) * 2, mask=p < num_parts, other=float("-inf"))
    s = tl.load(stats_ptr + (r * num_parts + p) * 2 + 1, mask=p < num_parts, other=0.0)
    big = tl.max(m, axis=0)
    lse = big + tl.log(tl.sum(tl.where(p < num_parts, s * tl.exp(m - big), 0.0), axis=0))
    row = tl.load(rows_ptr + r)
    token = tl.load(tokens_ptr + r)
    tl.store(chosen_ptr + r, tl.load(logits_ptr + row * stride_logits + token).to(tl.float32) - lse)
    if TOP > 0:
        c = tl.arange(0, BLOCK_C)
        live = c < num_parts * TOP
        vals = tl.load(cand_val_ptr + r * num_parts * TOP + c, mask=live, other=float("-inf"))
        ids = tl.load(cand_idx_ptr + r * num_parts * TOP + c, mask=live, other=2147483647)
        for j in tl.static_range(TOP):
            v = tl.max(vals, axis=0)
            i = tl.min(tl.where(vals == v, ids, 2147483647), axis=0)
            tl.store(top_val_ptr + r * TOP + j, v - lse)
            tl.store(top_idx_ptr + r * TOP + j, i.to(tl.int64))
            vals = tl.where(ids == i, float("-inf"), vals)


_launch_parts = FastLaunch(_parts_kernel)  # a decode step launches these: keep Triton's per-call binding off it
_launch_merge = FastLaunch(_merge_kernel)


def row_logprobs(
    logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, top: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(chosen [R] f32, top values [R, top] f32, top ids [R, top] int64) of logits rows `rows`
    for `tokens` (both [R] int64 on the logits' device); `top` = 0: no top entries (None, None).
    Queued on the device, no host sync."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError("row_logprobs needs [B, V] logits with contiguous rows")
    if not 0 <= top <= MAX_TOP:
        raise ValueError(f"row_logprobs takes 0..{MAX_TOP} top entries, got {top}")
    num_rows, vocab = len(rows), logits.shape[1]
    slots = next_power_of_2(top) if top else 0
    num_parts = cdiv(vocab, _PART)
    device = logits.device
    stats = torch.empty(num_rows * num_parts * 2, dtype=torch.float32, device=device)
    cand_val = torch.empty(max(1, num_rows * num_parts * slots), dtype=torch.float32, device=device)
    cand_idx = torch.empty(max(1, num_rows * num_parts * slots), dtype=torch.int32, device=device)
    chosen = torch.empty(num_rows, dtype=torch.float32, device=device)
    top_val = torch.empty(num_rows, max(1, slots), dtype=torch.float32, device=device)
    top_idx = torch.empty(num_rows, max(1, slots), dtype=torch.int64, device=device)
    if num_rows == 0:
        return chosen, (top_val[:, :top] if top else None), (top_idx[:, :top] if top else None)
    _launch_parts((num_rows, num_parts, 1), (logits, logits.stride(0), rows, stats, cand_val, cand_idx, vocab,
                                             num_parts), {"TOP": slots, "PART": _PART}, num_warps=8)
    _launch_merge((num_rows, 1, 1), (logits, logits.stride(0), rows, tokens, stats, cand_val, cand_idx, chosen, top_val,
                                     top_idx, num_parts),
                  {"TOP": slots, "BLOCK_P": next_power_of_2(num_parts),
                   "BLOCK_C": next_power_of_2(max(1, num_parts * slots))}, num_warps=4)
    if not top:
        return chosen, None, None
    return chosen, top_val[:, :top], top_idx[:, :top]
