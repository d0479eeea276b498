"""RMSNorm carried by the decode projections: no kernel of its own between them.

A decode layer (`engine/models/fused.py`) ran an add+RMSNorm kernel before the qkv and the
gate_up projections: 32 launches a step of a 16-layer model, each a grid boundary in the
PDL chain for ~2 µs of work (benchmarks/RESULTS.md, session 22). Here its two halves ride in
the projections on either side:

- the producer (the `o` projection; the `down` projection, whole or split over K) adds its
  result into the residual stream in its epilogue — rounded as the norm kernel rounds that
  add — and writes, per output tile, each row's sum of squares of the new residual:
  `stats` [tiles, M] fp32 (`add_to_residual`). A split-K producer's last program of each
  output tile (an arrival counter per tile) sums the tile's partials in range order first
  (`finish_split`), the order `kernels.norm` sums them in.
- the consumer (qkv with rotary, gate_up with SwiGLU) reads the raw residual as its x,
  turns the stats into each row's 1 / rms (`row_rstd`) and normalizes every x tile it loads
  (`normalize`): weight * round(x * rstd), rounded — the norm kernel's arithmetic, so the
  result differs from the unfused path only by the summation order of the squares.

Each consumer program reads the whole stats array (up to 128 tiles x 64 rows, 32 KB, from
L2) once. Tiles' sums are added in a fixed order: no atomics in any sum, same bits every run.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = ["RowNorm", "add_to_residual", "finish_split", "normalize", "row_rstd"]


class RowNorm(NamedTuple):
    """What a consumer needs to normalize the residual stream it reads as x: `stats` [P, M]
    fp32 (the producer's per-tile sums of squares of each row), the norm's `weight` [K] and `eps`."""

    stats: torch.Tensor
    weight: torch.Tensor
    eps: float


def check_row_norm(norm: RowNorm, rows: int, k: int) -> None:
    stats, weight, _ = norm
    if stats.dim() != 2 or stats.shape[1] != rows or stats.dtype != torch.float32 or not stats.is_contiguous():
        raise ValueError(f"norm stats must be contiguous float32 [tiles, {rows}], got {tuple(stats.shape)} {stats.dtype}")
    if weight.shape != (k,):
        raise ValueError(f"norm weight must be [{k}], got {tuple(weight.shape)}")


def norm_args(norm: RowNorm | None, x: torch.Tensor) -> tuple:
    """(stats, weight, eps) pointers for a launch, and the PARTS / PARTS_BLOCK constexprs
    (0: no norm; x itself stands in for the unused pointers)."""
    if norm is None:
        return (x, x, 0.0), dict(NORM_PARTS=0, NORM_BLOCK=1)
    check_row_norm(norm, x.shape[0], x.shape[1])
    parts = norm.stats.shape[0]
    return (norm.stats, norm.weight, float(norm.eps)), dict(NORM_PARTS=parts, NORM_BLOCK=min(16, _pow2(parts)))


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@triton.jit
def row_rstd(stats_ptr, M, offs_m, mask_m, eps, K: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr):
    """1 / sqrt(mean of squares + eps) of rows offs_m from stats [PARTS, M] (tiles summed in order
    of BLOCK at a time)."""
    ss = tl.zeros(offs_m.shape, tl.float32)
    for p0 in tl.static_range(0, PARTS, BLOCK):
        parts = p0 + tl.arange(0, BLOCK)
        block = tl.load(stats_ptr + parts[:, None] * M + offs_m[None, :], mask=(parts < PARTS)[:, None] & mask_m[None, :],
                        other=0.0)
        ss += tl.sum(block, 0)
    return 1.0 / tl.sqrt(ss / K + eps)


@triton.jit
def normalize(x, rstd, g_ptr, cols, mask_k):
    """x tile [BLOCK_M, BLOCK_K] (columns `cols`) -> weight * round(x * rstd), in x's dtype."""
    dtype = x.dtype
    g = tl.load(g_ptr + cols, mask=mask_k, other=0.0).to(tl.float32)
    normed = (x.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)
    return (g[None, :] * normed).to(dtype)


@triton.jit
def add_to_residual(y, res_ptr, stride_rm, stats_ptr, M, tile, offs_m, offs_n, mask_m, mask_n):
    """residual <- round(y + residual) for the tile (y already rounded to the residual's dtype,
    as a projection stores it); stats[tile, m] <- sum over the tile's columns of the new
    residual's squares."""
    ptrs = res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    r = tl.load(ptrs, mask=mask, other=0.0)
    s = (y.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
    tl.store(ptrs, s, mask=mask)
    s32 = tl.where(mask, s.to(tl.float32), 0.0)
    tl.store(stats_ptr + tile * M + offs_m, tl.sum(s32 * s32, 1), mask=mask_m)


@triton.jit
def finish_split(part_ptrs, stride_os, mask, count_ptr, res_ptr, stride_rm, stats_ptr, M, tile, offs_m, offs_n,
                 mask_m, mask_n, RANGES: tl.constexpr):
    """Called by every program of a split-K tile once its partial is stored (`part_ptrs` of
    range 0 for the tile; range s at + s * stride_os): the last to arrive sums the RANGES
    partials in order, rounds, adds into the residual (`add_to_residual`) and re-arms the
    tile's counter, so the counters are all zero again between launches (a CUDA graph replays
    them as they are)."""
    tl.debug_barrier()  # every thread's partial is stored before the program counts itself in
    arrived = tl.atomic_add(count_ptr + tile, 1)  # acq_rel: earlier programs' partials are visible
    if arrived == RANGES - 1:
        total = tl.load(part_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, RANGES):
            total += tl.load(part_ptrs + s * stride_os, mask=mask, other=0.0, cache_modifier=".cg")
        add_to_residual(total.to(res_ptr.dtype.element_ty), res_ptr, stride_rm, stats_ptr, M, tile, offs_m, offs_n,
                        mask_m, mask_n)
        tl.atomic_xchg(count_ptr + tile, 0)
