"""RMSNorm with an optional fused residual add, one program per token.

    residual is None:  out = weight * round(x * rsqrt(mean(x^2) + eps))
    residual given:    s = round(x + residual); residual <- s (in place)
                       out = weight * round(s * rsqrt(mean(s^2) + eps))

`embed_rms_norm` gathers x's rows from an embedding table by token id in the same launch and
stores them as the residual stream: the first decoder layer's input norm with the embedding
lookup, which was a torch kernel of its own outside the programmatic-dependent-launch chain.

x may also come as split-K partial sums [S, T, H] in fp32 (`kernels.decode_linear_partials`,
with a residual): x is then round(sum of the partials) — what the projection would have
stored — so the reduction of a split projection costs no kernel of its own.

`round` is the cast to the activation dtype: the arithmetic (fp32 statistics,
one rounding, then the weight multiply) is the unfused model's, so the fused
GPU path differs from it only by summation order. One launch replaces the ~8
elementwise kernels of the unfused norm (plus the residual add), which is what
a decode step on a small model is made of.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_last_dim_contiguous, next_power_of_2
from ._pdl import pdl_launch, wait_for_producer
from .elementwise_reference import rms_norm_reference

__all__ = ["add_residual", "embed_rms_norm", "rms_norm", "rms_norm_reference"]


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    ids_ptr,
    stride_x,
    stride_xs,
    stride_res,
    stride_out,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PARTS: tl.constexpr,
    NORMALIZE: tl.constexpr,
    GATHER: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producer(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + t * stride_res + offs, mask=mask, other=0.0)
        dtype = r.dtype
        if PARTS > 0:  # split-K partials of x, fp32: their sum rounded is x
            x = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
            for part in tl.static_range(1, PARTS):
                x += tl.load(x_ptr + part * stride_xs + t * stride_x + offs, mask=mask, other=0.0)
            x = x.to(dtype)
        else:
            x = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(res_ptr + t * stride_res + offs, x, mask=mask)
    elif GATHER:  # x is an embedding table: row ids[t], stored as the residual stream
        row = tl.load(ids_ptr + t).to(tl.int64)
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        dtype = x.dtype
        tl.store(res_ptr + t * stride_res + offs, x, mask=mask)
    else:
        x = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
        dtype = x.dtype
    if NORMALIZE:  # (add_residual: the sum alone)
        x32 = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / HIDDEN + eps)
        normed = (x32 * rstd).to(dtype).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * stride_out + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, H] -> [T, H] in x.dtype. With `residual` [T, H]: residual <- x + residual
    (in place) and the norm is taken of that sum; x may then be fp32 split-K partials [S, T, H]
    (see the module docstring), and the result is in residual's dtype. Rows must be contiguous."""
    return _launch(x, weight, eps, residual, True)


def add_residual(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual <- x + residual in place, rounded as `rms_norm(x, ..., residual=)` adds (x [T, H],
    or fp32 split-K partials [S, T, H] summed in order and rounded first), with no norm taken;
    returns residual. The end of a stage's decoder layers, whose output is the residual stream:
    one launch under programmatic dependent launch where torch's sum, cast and add were three
    plain ones (~7 µs of a batch-64 decode step on an H100, benchmarks/RESULTS.md session 31)."""
    if residual is None or residual.dim() != 2:
        raise ValueError(f"add_residual needs a residual [T, H], got {None if residual is None else tuple(residual.shape)}")
    if residual.shape[0] == 0:
        return residual
    _launch(x, residual[0], 0.0, residual, False)  # (a weight of the right shape; not read)
    return residual


NUM_WARPS: int | None = None
"""Warps of a norm program; None: 8 from 4096 columns, else 4 (an A/B switch for
benchmarks/decode_sweep.py)."""


def _warps(block: int) -> int:
    return NUM_WARPS or (8 if block >= 4096 else 4)


def embed_rms_norm(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(table[ids]), table[ids]): token ids [T] (integers in [0, V), checked by the
    engine's input validation, not here), embedding table [V, H] -> the first layer's normed
    input and the residual stream [T, H] in the table's dtype, in one launch."""
    if ids.dim() != 1 or ids.dtype.is_floating_point or table.dim() != 2 or weight.shape != (table.shape[1],):
        raise ValueError(f"ids must be integer [T], table [V, H] and weight [H], got {tuple(ids.shape)} "
                         f"{ids.dtype}, {tuple(table.shape)} and {tuple(weight.shape)}")
    check_last_dim_contiguous("table", table)
    residual = torch.empty(ids.shape[0], table.shape[1], dtype=table.dtype, device=table.device)
    out = torch.empty_like(residual)
    if ids.shape[0]:
        block = next_power_of_2(table.shape[1])
        _rms_norm_kernel[(ids.shape[0],)](
            table, residual, weight, out, ids, table.stride(0), 0, residual.stride(0), out.stride(0), eps,
            HIDDEN=table.shape[1], BLOCK=block, HAS_RESIDUAL=False, PARTS=0, NORMALIZE=True, GATHER=True,
            num_warps=_warps(block), **pdl_launch(table.device),
        )
    return out, residual


def _launch(x, weight, eps, residual, normalize: bool) -> torch.Tensor:
    parts = x.shape[0] if x.dim() == 3 else 0
    if parts and (residual is None or x.dtype != torch.float32):
        raise ValueError("x as partials [S, T, H] must be float32 and come with a residual")
    rows = x[0] if parts else x
    if rows.dim() != 2 or weight.shape != (rows.shape[1],):
        raise ValueError(f"x must be [T, H] (or [S, T, H] partials) and weight [H], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if residual is not None and (residual.shape != rows.shape or (not parts and residual.dtype != x.dtype)):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x {tuple(x.shape)} {x.dtype}")
    check_last_dim_contiguous("x", x)
    out = torch.empty_like(residual if parts else x) if normalize else residual  # (not written unless normalize)
    num_tokens, hidden = rows.shape
    if num_tokens == 0:
        return out
    block = next_power_of_2(hidden)
    res = residual if residual is not None else x
    check_last_dim_contiguous("residual", res)
    _rms_norm_kernel[(num_tokens,)](
        x, res, weight, out, x, rows.stride(0), x.stride(0) if parts else 0, res.stride(0), out.stride(0), eps,
        HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None, PARTS=parts, NORMALIZE=normalize, GATHER=False,
        num_warps=_warps(block), **pdl_launch(x.device),
    )
    return out
