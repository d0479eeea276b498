"""Logit bias and presence / frequency penalties added into a step's logits: one launch for every
adjusted row of the step, from per-request count and bias rows kept on the device.

    logits [B, V]            rows adjusted in place
    counts, bias [S, V] f32  per request slot: how often each token occurs in its output so far,
                             and its logit bias (engine/logit_slots.py keeps them)
    table float64            a header per adjusted row r:
                               logit row, slot, fed index (-1: none), frequency, presence,
                               first new id, end new id, token index (-1: none)
                             then the new ids of all rows: output tokens not yet in `counts`
    fed [N] int (optional)   a step's input ids; a row's fed index names its previous token,
                             still only on the device (counted here, like the new ids)

    tokens [N] (optional)    where a greedy row's argmax goes (its token index)

Grid (rows, vocabulary parts of `_PART`): a program first adds the row's new ids (and its fed
token) that fall in its part into the counts row, then for every token v of its part:
    logit[v] += bias[v] - (frequency * count[v] + presence * [count[v] > 0])
(OpenAI's definition; the delta rounded once, then the add), keeping the first index of its
part's maximum on the way; for greedy rows a second launch merges the parts' maxima into the
row's token (as torch.argmax: the first index of the maximum) — no second pass over the row.

So the host sends a few ids a step, however long the output: a table of every token each row
had ever produced (tried first) cost a batch of 64 with 64 penalized rows 12.6 ms a step on the
H100, host-bound; a dense count tensor rebuilt every step cost one penalized row ~1 ms in
launches. The pass over the vocabulary reads 8 bytes a token per row: ~1 MB a row at a 128k
vocabulary, a few µs of GPU time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, next_power_of_2
from ._launch import FastLaunch

__all__ = ["HEADER", "adjust_logit_rows"]

HEADER = 8
_PART = 8192  # vocabulary entries a program adjusts: a 128k row spread over 16 multiprocessors
_BLOCK = 1024


@triton.jit(do_not_specialize=["first_new"])  # num_rows * HEADER: one compile for any row count
def _adjust_kernel(logits_ptr, stride_logits, counts_ptr, bias_ptr, stride_slot, table_ptr, fed_ptr, part_val_ptr,
                   part_idx_ptr, first_new, vocab, num_parts, HAS_FED: tl.constexpr, PART: tl.constexpr,
                   BLOCK: tl.constexpr):
    r = tl.program_id(0)
    part = tl.program_id(1)
    head = table_ptr + r * 8
    row = tl.load(head).to(tl.int64)
    slot = tl.load(head + 1).to(tl.int64)
    fed_at = tl.load(head + 2).to(tl.int64)
    freq = tl.load(head + 3).to(tl.float32)
    pres = tl.load(head + 4).to(tl.float32)
    start = tl.load(head + 5).to(tl.int32)
    end = tl.load(head + 6).to(tl.int32)
    lo = part * PART
    hi = tl.minimum(lo + PART, vocab)
    count_row = counts_ptr + slot * stride_slot
    # This program's share of the vocabulary is its own: the ids it counts are those in it, so
    # no other program reads what it adds (ids may repeat: atomics).
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        tok = tl.load(table_ptr + first_new + idx, mask=idx < end, other=-1.0).to(tl.int64)
        mine = (idx < end) & (tok >= lo) & (tok < hi)
        tl.atomic_add(count_row + tok, tl.full([BLOCK], 1.0, tl.float32), mask=mine)
    if HAS_FED:
        fed_tok = tl.load(fed_ptr + tl.maximum(fed_at, 0)).to(tl.int64)
        tl.atomic_add(count_row + fed_tok, 1.0, mask=(fed_at >= 0) & (fed_tok >= lo) & (fed_tok < hi))
    tl.debug_barrier()  # the counts added above, visible to every thread of the program
    bias_row = bias_ptr + slot * stride_slot
    logit_row = logits_ptr + row * stride_logits
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_at = tl.full([BLOCK], 0, tl.int32)
    for off in range(0, PART, BLOCK):
        v = lo + off + tl.arange(0, BLOCK)
        valid = v < hi
        c = tl.load(count_row + v, mask=valid, other=0.0)
        b = tl.load(bias_row + v, mask=valid, other=0.0)
        delta = b - (freq * c + pres * (c > 0).to(tl.float32))
        x = tl.load(logit_row + v, mask=valid, other=0.0)
        y = (x.to(tl.float32) + delta).to(x.dtype)
        tl.store(logit_row + v, y, mask=valid)
        better = valid & (y.to(tl.float32) > best)  # strict: each lane keeps its first maximum
        best = tl.where(better, y.to(tl.float32), best)
        best_at = tl.where(better, v, best_at)
    top = tl.max(best, 0)
    tl.store(part_val_ptr + r * num_parts + part, top)
    tl.store(part_idx_ptr + r * num_parts + part, tl.min(tl.where(best == top, best_at, vocab), 0))


@triton.jit
def _argmax_kernel(table_ptr, part_val_ptr, part_idx_ptr, tokens_ptr, num_parts, vocab, BLOCK_P: tl.constexpr):
    """A row's argmax from its parts' (max, first index), ties to the lower index, to its token
    index (rows without one: nothing)."""
    r = tl.program_id(0)
    token_at = tl.load(table_ptr + r * 8 + 7).to(tl.int64)
    offs = tl.arange(0, BLOCK_P)
    valid = offs < num_parts
    val = tl.load(part_val_ptr + r * num_parts + offs, mask=valid, other=float("-inf"))
    idx = tl.load(part_idx_ptr + r * num_parts + offs, mask=valid, other=vocab)
    first = tl.min(tl.where(val == tl.max(val, 0), idx, vocab), 0)
    tl.store(tokens_ptr + tl.maximum(token_at, 0), first.to(tokens_ptr.dtype.element_ty), mask=token_at >= 0)


_launch = FastLaunch(_adjust_kernel)
_launch_argmax = FastLaunch(_argmax_kernel)


def adjust_logit_rows(
    logits: torch.Tensor, counts: torch.Tensor, bias: torch.Tensor, table: torch.Tensor, num_rows: int,
    fed: torch.Tensor | None = None, tokens: torch.Tensor | None = None,
) -> None:
    """Adjust `num_rows` rows of `logits` [B, V] in place and add their new ids into `counts`
    (layout above; `counts` and `bias` [S, V] float32 with one stride, `table` float64, all on
    the logits' device). `fed`: the step's input ids, or None when no row names one; `tokens`:
    where rows with a token index write their argmax (None: no row has one)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [B, V] with contiguous rows, got {tuple(logits.shape)}")
    vocab = logits.shape[1]
    for name, t in (("counts", counts), ("bias", bias)):
        if t.dtype != torch.float32 or t.dim() != 2 or t.shape[1] != vocab or t.stride() != counts.stride():
            raise ValueError(f"{name} must be float32 [slots, {vocab}] like counts, got {t.dtype} {tuple(t.shape)}")
    if table.dtype != torch.float64 or table.device != logits.device:
        raise ValueError(f"table must be float64 on {logits.device}, got {table.dtype} on {table.device}")
    if num_rows == 0:
        return
    parts = cdiv(vocab, _PART)
    part_val = torch.empty(num_rows, parts, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(num_rows, parts, dtype=torch.int32, device=logits.device)
    has_fed = fed is not None
    args = (logits, logits.stride(0), counts, bias, counts.stride(0), table, fed if has_fed else table, part_val,
            part_idx, num_rows * HEADER, vocab, parts)  # fmt: skip
    _launch((num_rows, parts, 1), args, {"HAS_FED": has_fed, "PART": _PART, "BLOCK": _BLOCK}, num_warps=4)
    if tokens is not None:
        _launch_argmax((num_rows, 1, 1), (table, part_val, part_idx, tokens, parts, vocab),
                       {"BLOCK_P": next_power_of_2(parts)}, num_warps=1)  # fmt: skip
