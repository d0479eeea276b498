"""Decode-batch linear layer for the LM head: out = x @ w^T for few rows, fp32 out.

    x [M, K] (M <= MAX_ROWS), w [N, K] -> out [M, N] in out_dtype (default x.dtype)

At decode batch sizes a projection reads its whole weight matrix to produce a
few rows, so time is weight bytes / HBM bandwidth. For the LM head ([128k, 2048]
for Llama 3, 525 MB in bf16) cuBLAS plus the `.float()` of the logits took
173 µs at 64 rows on an H200 (3.0 TB/s) against 145 µs here (3.6 TB/s), and
132 vs 124 µs at one row: grid N / BLOCK_N, each program reads its weight tile
[BLOCK_N, K] once and the few rows of x (served from L2), accumulates in fp32
and stores the result in the asked dtype, so fp32 logits need no second pass.

The per-layer projections stay on cuBLAS: the same kernel (and a split-K
variant with a last-program fix-up) at best matched it (gate_up, one row) and
was up to 2.2x slower on the [3072 | 2048 | 16384, 2048] and [2048, 8192]
shapes at 1 and 64 rows (benchmarks/RESULTS.md, 2026-12-02).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, check_last_dim_contiguous, dot_precision, next_power_of_2

__all__ = ["MAX_ROWS", "LinearConfig", "decode_linear", "linear_reference"]

MAX_ROWS = 64
"""Most rows (decode tokens) the kernel takes; larger batches are compute-shaped, for cuBLAS."""


@triton.jit
def _linear_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    stride_xm,
    stride_wn,
    stride_om,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + offs_k
        w = tl.load(w_rows + cols[None, :], mask=mask_n[:, None] & (cols < K)[None, :], other=0.0)
        x = tl.load(x_rows + cols[None, :], mask=mask_m[:, None] & (cols < K)[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


class LinearConfig(tuple):
    """(block_n, block_k, num_warps, num_stages); the default is the best of a sweep at
    the Llama-3 LM-head shape on an H200, 1 and 64 rows."""

    __slots__ = ()

    def __new__(cls, block_n: int = 128, block_k: int = 128, num_warps: int = 4, num_stages: int = 4):
        return super().__new__(cls, (block_n, block_k, num_warps, num_stages))


def decode_linear(
    x: torch.Tensor, weight: torch.Tensor, *, out_dtype: torch.dtype | None = None, config: LinearConfig | None = None
) -> torch.Tensor:
    """x [M, K], weight [N, K], rows contiguous, M <= MAX_ROWS -> [M, N] in out_dtype
    (default x.dtype), fp32 accumulation; fp32 inputs use IEEE (not tf32) products."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}")
    rows, k = x.shape
    n = weight.shape[0]
    if rows > MAX_ROWS:
        raise ValueError(f"decode_linear() takes at most {MAX_ROWS} rows, got {rows}")
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    out = torch.empty(rows, n, dtype=out_dtype or x.dtype, device=x.device)
    if rows == 0:
        return out
    if config is None:  # 4-byte operands: half the K tile and fewer stages fit shared memory
        config = LinearConfig() if x.element_size() <= 2 else LinearConfig(block_k=64, num_stages=2)
    block_n, block_k, num_warps, num_stages = config
    block_k = min(block_k, max(16, next_power_of_2(k)))
    _linear_kernel[(cdiv(n, block_n),)](
        x, weight, out, rows, n, x.stride(0), weight.stride(0), out.stride(0),
        K=k, BLOCK_M=max(16, next_power_of_2(rows)), BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=dot_precision(x.dtype), num_warps=num_warps, num_stages=num_stages,
    )
    return out


def linear_reference(x: torch.Tensor, weight: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """F.linear in fp32, rounded to out_dtype (default x.dtype)."""
    return (x.float() @ weight.float().t()).to(out_dtype or x.dtype)
