"""Batched sampling on the device: temperature, top-k, top-p and a seeded draw for
every sampled row of a step at once, with no host round trip per row.

    logits [N, V] float32, temperature / top_k / top_p / seeds [N] -> token ids [N] int64

Temperature and the top-k / top-p masks are batched torch ops (one `topk` with the
largest k of the batch, one `sort` only when some row uses top-p). The draw is the
Gumbel-max trick — argmax(x + g), g = -log(-log(u)) — with u from Triton's Philox
generator keyed by (row seed, vocabulary index): a token depends only on its
request's seed and position (folded into `seeds` by the caller) and never on the
batch it ran in. Two launches, like `argmax.py`.

The host-side sampler (engine/sampler.py, torch.multinomial) remains the CPU path
and the path of rows that need log-probs; a given device type always draws the same
tokens for the same seed, so prefill and decode engines on GPUs agree.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, check_last_dim_contiguous, next_power_of_2
from ._pdl import pdl_launch
from .argmax import _merge_argmax_kernel

__all__ = ["mask_logits", "sample_rows"]

_BLOCK = 4096


def mask_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, *,
    max_top_k: int | None = None, any_top_p: bool | None = None, top_p_within_top_k: bool | None = None,
) -> torch.Tensor:
    """Temperature, then top-k (k <= 0 or >= V: off), then top-p (p outside (0, 1): off), as
    engine/sampler.process_logits does for one row; masked entries are -inf.

    `max_top_k` (largest active k, 0 for none) and `any_top_p` are what the caller knows
    from the requests' parameters; passing them avoids reading them back from the device.
    When every top-p row also has a top-k (`top_p_within_top_k`, likewise known to the
    caller), top-p works on the `topk` values (already sorted) instead of sorting the whole
    vocabulary."""
    x = logits / temperature[:, None]
    vocab = x.shape[1]
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = (top_p > 0) & (top_p < 1)
    if max_top_k is None:
        max_top_k = int(torch.where(use_k, top_k, 0).max()) if len(top_k) else 0
    if any_top_p is None:
        any_top_p = bool(use_p.any())
    values = None
    if max_top_k > 0:
        values = torch.topk(x, max_top_k, dim=-1).values  # [N, max_k], descending
        k = torch.where(use_k, top_k, max_top_k)
        kth = values.gather(1, (k - 1)[:, None])
        x = x.masked_fill((x < kth) & use_k[:, None], float("-inf"))
        values = values.masked_fill(torch.arange(max_top_k, device=x.device)[None, :] >= k[:, None], float("-inf"))
    if not any_top_p:
        return x
    if top_p_within_top_k is None:
        top_p_within_top_k = bool((use_k | ~use_p).all())
    if values is not None and top_p_within_top_k:
        sorted_x = values  # each top-p row's kept set lies in its own top-k values
    else:
        sorted_x = torch.sort(x, dim=-1, descending=True).values
    probs = torch.softmax(sorted_x, dim=-1)
    drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p[:, None]
    drop[:, 0] = False
    cutoff = torch.where(drop | torch.isinf(sorted_x), float("inf"), sorted_x).min(dim=-1).values
    return x.masked_fill((x < cutoff[:, None]) & use_p[:, None], float("-inf"))


@triton.jit
def _row_thresholds(values_ptr, temp_ptr, k_ptr, p_ptr, thr_ptr, stride_v, num_values, vocab,
                    KP: tl.constexpr, USE_P: tl.constexpr):
    """One program per row: the lowest kept value (in temperature-scaled units) from the row's
    top values `[num_values]` (descending, raw logits), as `mask_logits` keeps them: top-k
    keeps values >= the k-th, then top-p keeps the shortest head whose mass before it is < p."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, KP)
    t = tl.load(temp_ptr + row)
    k = tl.load(k_ptr + row)
    use_k = (k > 0) & (k < vocab)
    k = tl.where(use_k, k, num_values)
    valid = (offs < num_values) & (offs < k)
    v = tl.load(values_ptr + row * stride_v + offs, mask=valid, other=float("-inf")).to(tl.float32)
    scaled = tl.where(valid, tl.math.div_rn(v, t), float("-inf"))
    thr = tl.where(use_k, tl.min(tl.where(valid, scaled, float("inf")), 0), float("-inf"))
    if USE_P:
        p = tl.load(p_ptr + row)
        e = tl.where(valid, tl.exp(scaled - tl.max(scaled, 0)), 0.0)
        probs = e / tl.sum(e, 0)
        before = tl.cumsum(probs, 0) - probs
        keep = valid & ((before < p) | (offs == 0))
        cutoff = tl.min(tl.where(keep, scaled, float("inf")), 0)
        thr = tl.where((p > 0) & (p < 1), tl.maximum(thr, cutoff), thr)
    tl.store(thr_ptr + row, thr)


@triton.jit
def _partial_gumbel_argmax(x_ptr, rows_ptr, temp_ptr, thr_ptr, seeds_ptr, part_val_ptr, part_idx_ptr, stride_x,
                           vocab, num_parts, BLOCK: tl.constexpr):
    """Stage 1 of the draw: per (row, slice), the (max, first index) of x / T + Gumbel noise
    over the entries at or above the row's threshold (the rest are masked off)."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    src = tl.load(rows_ptr + row)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab
    x = tl.load(x_ptr + src * stride_x + offs, mask=mask, other=float("-inf")).to(tl.float32)
    scaled = tl.math.div_rn(x, tl.load(temp_ptr + row))
    keep = mask & (scaled >= tl.load(thr_ptr + row))
    seed = tl.load(seeds_ptr + row)
    u = tl.rand(seed, offs)
    g = -tl.log(-tl.log(u + 1e-20) + 1e-20)
    y = tl.where(keep, scaled + g, float("-inf"))
    best = tl.max(y, 0)
    idx = tl.min(tl.where(y == best, offs, vocab), 0)
    tl.store(part_val_ptr + row * num_parts + part, best)
    tl.store(part_idx_ptr + row * num_parts + part, idx)


def sample_rows(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor,
    *, max_top_k: int | None = None, any_top_p: bool | None = None, top_p_within_top_k: bool | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row. Every row must have temperature > 0 (greedy rows are an argmax
    elsewhere; the caller checks, on the host). `seeds` int64 [N] (folded with the output
    position by the caller); `max_top_k` / `any_top_p` / `top_p_within_top_k` as in
    `mask_logits` (given all three, nothing is read back from the device). `rows` int64 [N]:
    the logits row of each (default: row i), so the caller need not gather them first.

    Given the three flags, and unless a top-p row lacks a top-k (which needs the whole
    vocabulary sorted: `mask_logits`), the masks never materialise: one `topk` of the raw
    logits, one program per row turning its top values into a threshold, and the draw
    scaling, masking and adding noise as it reads — 4 launches instead of ~30 small torch
    ops, whose host cost (~0.6 ms a step on the H200 host) bounded a sampled decode step."""
    n = len(seeds)
    if logits.dim() != 2 or not (len(temperature) == len(top_k) == len(top_p) == n):
        raise ValueError(f"logits [N, V] and four [N] parameter tensors expected, got {tuple(logits.shape)}")
    if rows is None and logits.shape[0] != n:
        raise ValueError(f"{n} rows of parameters for {logits.shape[0]} rows of logits (pass `rows`)")
    out = torch.empty(n, dtype=torch.long, device=logits.device)
    if n == 0:
        return out
    # The kernels index these by row: a strided view (a column of a parameter table) would be
    # read as if it were contiguous — every row but the first with another row's values.
    temperature, top_k, top_p, seeds = (v.contiguous() for v in (temperature, top_k, top_p, seeds))
    if rows is not None:
        rows = rows.contiguous()
    vocab = logits.shape[1]
    known = max_top_k is not None and any_top_p is not None and top_p_within_top_k is not None
    temperature = temperature.float()
    thr = torch.full((n,), float("-inf"), dtype=torch.float32, device=logits.device)
    if known and (top_p_within_top_k or not any_top_p):
        x = logits if logits.stride(-1) == 1 else logits.contiguous()
        if max_top_k > 0:
            values = torch.topk(x if rows is None else x[rows], max_top_k, dim=-1).values
            _row_thresholds[(n,)](values, temperature, top_k, top_p, thr, values.stride(0), max_top_k, vocab,
                                  KP=next_power_of_2(max_top_k), USE_P=bool(any_top_p), num_warps=4)
        if rows is None:
            rows = torch.arange(n, device=logits.device)
    else:  # the general path: masked, scaled logits first
        x = logits if rows is None else logits[rows]
        x = mask_logits(x.float(), temperature, top_k, top_p, max_top_k=max_top_k, any_top_p=any_top_p,
                        top_p_within_top_k=top_p_within_top_k).contiguous()
        temperature = torch.ones_like(temperature)
        rows = torch.arange(n, device=logits.device)
    check_last_dim_contiguous("logits", x)
    block = min(_BLOCK, next_power_of_2(vocab))
    parts = cdiv(vocab, block)
    part_val = torch.empty(n, parts, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(n, parts, dtype=torch.int32, device=x.device)
    _partial_gumbel_argmax[(n, parts)](x, rows, temperature, thr, seeds, part_val, part_idx, x.stride(0), vocab, parts,
                                       BLOCK=block, num_warps=8 if block >= 2048 else 4)
    _merge_argmax_kernel[(n,)](part_val, part_idx, out, parts, vocab, BLOCK_P=next_power_of_2(parts), num_warps=1,
                               **pdl_launch(x.device))
    return out
