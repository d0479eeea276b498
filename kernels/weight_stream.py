"""The device functions every decode projection kernel streams its weights with
(`kernels.linear`, `kernels.qkv_rotary`): the PDL wait with the first weight tile loaded before
it, the fp32 sums over a K range, a folded RMSNorm's 1 / rms from partial sums of squares, and
the split of a paired gate/up tile."""

from __future__ import annotations

import triton
import triton.language as tl

from ._pdl import wait_for_producer

__all__ = ["first_weight_tile", "rows_rstd", "split_halves", "stream_weight_tile"]


@triton.jit
def first_weight_tile(w_rows, mask_n, k_start, k_end, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                      EARLY: tl.constexpr):
    """The wait for the previous kernel (`wait_for_producer`); EARLY: the program's first weight
    tile [BLOCK_N, BLOCK_K] is loaded before it and returned — no kernel of a step writes
    weights, so under programmatic dependent launch its DRAM latency overlaps the previous
    kernel's drain instead of following it (else 0, unused)."""
    if EARLY:
        cols = k_start + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + cols[None, :], mask=mask_n[:, None] & (cols < k_end)[None, :], other=0.0)
        wait_for_producer(PDL)
        return w
    else:
        wait_for_producer(PDL)
        return 0


@triton.jit
def stream_weight_tile(x_rows, w_rows, w_first, mask_m, mask_n, k_start, k_end,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, EARLY: tl.constexpr):
    """fp32 sums over K in [k_start, k_end) of x rows (pointers [BLOCK_M, 1]) times weight rows
    (pointers [BLOCK_N, 1], any rows: a tile may gather two runs of rows): the weight stream of
    every kernel here. EARLY: the first K tile's weights are `w_first` (`first_weight_tile`).
    x goes from its load to the MMA untouched: normalizing it in the loop cost 16 µs a layer at
    64 rows on an H200 (benchmarks/RESULTS.md, session 25), so a folded norm scales the sums."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    k_loop = k_start
    if EARLY:
        x = tl.load(x_rows + (k_start + offs_k)[None, :], mask=mask_m[:, None] & (k_start + offs_k < k_end)[None, :],
                    other=0.0)
        acc = tl.dot(x, tl.trans(w_first), acc, input_precision=DOT_PRECISION)
        k_loop = k_start + BLOCK_K
    for k in range(k_loop, k_end, BLOCK_K):
        cols = k + offs_k
        w = tl.load(w_rows + cols[None, :], mask=mask_n[:, None] & (cols < k_end)[None, :], other=0.0)
        x = tl.load(x_rows + cols[None, :], mask=mask_m[:, None] & (cols < k_end)[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def rows_rstd(sq_ptr, offs_m, mask_m, stride_sq, eps, K: tl.constexpr, PARTS: tl.constexpr,
              PARTS_BLOCK: tl.constexpr):
    """1 / rms of x's rows from the PARTS partial sums of their squares at `sq_ptr` [PARTS, M]
    (`decode_linear_add`'s), summed in a fixed order, PARTS_BLOCK at a time (a bounded register
    tile): rsqrt(mean(x^2) + eps) as `rms_norm`."""
    total = tl.zeros(offs_m.shape, tl.float32)
    for p0 in tl.static_range(0, PARTS, PARTS_BLOCK):
        p = p0 + tl.arange(0, PARTS_BLOCK)
        sq = tl.load(sq_ptr + p[:, None] * stride_sq + offs_m[None, :], mask=(p < PARTS)[:, None] & mask_m[None, :],
                     other=0.0)
        total += tl.sum(sq, 0)
    return 1.0 / tl.sqrt(total / K + eps)


@triton.jit
def split_halves(acc, BLOCK_M: tl.constexpr, HALF_N: tl.constexpr):
    """acc [BLOCK_M, 2 * HALF_N] -> its first and second HALF_N columns."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF_N)), (0, 2, 1)))
