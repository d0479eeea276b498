"""Logit bias and presence / frequency penalties added into a step's logits: one launch for every
adjusted row of the step, from per-request count and bias rows kept on the device.

    logits [B, V]            rows adjusted in place
    counts, bias [S, V] f32  per request slot: how often each token occurs in its output so far,
                             and its logit bias (engine/logit_slots.py keeps them)
    table float64            a header per adjusted row r:
                               logit row, slot, fed index (-1: none), frequency, presence,
                               first new id, end new id
                             then the new ids of all rows: output tokens not yet in `counts`
    fed [N] int (optional)   a step's input ids; a row's fed index names its previous token,
                             still only on the device (counted here, like the new ids)

A program per row first adds its new ids (and its fed token) into its counts row, then for
every token v:  logit[v] += bias[v] - (frequency * count[v] + presence * [count[v] > 0])
(OpenAI's definition; the delta rounded once, then the add).

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

from ._launch import FastLaunch

__all__ = ["HEADER", "adjust_logit_rows"]

HEADER = 7
_BLOCK = 1024


@triton.jit(do_not_specialize=["first_new"])  # num_rows * HEADER: one compile for any row count
def _adjust_kernel(logits_ptr, stride_logits, counts_ptr, bias_ptr, stride_slot, table_ptr, fed_ptr, first_new, vocab,
                   HAS_FED: tl.constexpr, BLOCK: tl.constexpr):
    head = table_ptr + tl.program_id(0) * 7
    row = tl.load(head).to(tl.int64)
    slot = tl.load(head + 1).to(tl.int64)
    fed_at = tl.load(head + 2).to(tl.int64)
    freq = tl.load(head + 3).to(tl.float32)
    pres = tl.load(head + 4).to(tl.float32)
    start = tl.load(head + 5).to(tl.int32)
    end = tl.load(head + 6).to(tl.int32)
    count_row = counts_ptr + slot * stride_slot
    for off in range(start, end, BLOCK):  # (ids may repeat: atomics)
        idx = off + tl.arange(0, BLOCK)
        valid = idx < end
        tok = tl.load(table_ptr + first_new + idx, mask=valid, other=0.0).to(tl.int64)
        tl.atomic_add(count_row + tok, tl.full([BLOCK], 1.0, tl.float32), mask=valid)
    if HAS_FED:
        fed_tok = tl.load(fed_ptr + tl.maximum(fed_at, 0)).to(tl.int64)
        tl.atomic_add(count_row + fed_tok, 1.0, mask=fed_at >= 0)
    tl.debug_barrier()  # the counts written above, visible to every thread of the program
    bias_row = bias_ptr + slot * stride_slot
    logit_row = logits_ptr + row * stride_logits
    for off in range(0, vocab, BLOCK):
        v = off + tl.arange(0, BLOCK)
        valid = v < vocab
        c = tl.load(count_row + v, mask=valid, other=0.0)
        b = tl.load(bias_row + v, mask=valid, other=0.0)
        delta = b - (freq * c + pres * (c > 0).to(tl.float32))
        x = tl.load(logit_row + v, mask=valid, other=0.0)
        tl.store(logit_row + v, (x.to(tl.float32) + delta).to(x.dtype), mask=valid)


_launch = FastLaunch(_adjust_kernel)


def adjust_logit_rows(
    logits: torch.Tensor, counts: torch.Tensor, bias: torch.Tensor, table: torch.Tensor, num_rows: int,
    fed: torch.Tensor | None = None,
) -> None:
    """Adjust `num_rows` rows of `logits` [B, V] in place and add their new ids into `counts`
    (layout above; `counts` and `bias` [S, V] float32 with one stride, `table` float64, all on
    the logits' device). `fed`: the step's input ids, or None when no row names one."""
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
    has_fed = fed is not None
    args = (logits, logits.stride(0), counts, bias, counts.stride(0), table, fed if has_fed else table,
            num_rows * HEADER, vocab)  # fmt: skip
    _launch((num_rows, 1, 1), args, {"HAS_FED": has_fed, "BLOCK": _BLOCK}, num_warps=8)
