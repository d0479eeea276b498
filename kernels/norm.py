"""RMSNorm with an optional fused residual add, one program per token.

    residual is None:  out = weight * round(x * rsqrt(mean(x^2) + eps))
    residual given:    s = round(x + residual); residual <- s (in place)
                       out = weight * round(s * rsqrt(mean(s^2) + eps))

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

__all__ = ["rms_norm", "rms_norm_reference"]


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_res,
    stride_out,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producer(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + t * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(res_ptr + t * stride_res + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / HIDDEN + eps)
    normed = (x32 * rstd).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, H] -> [T, H] in x.dtype. With `residual` [T, H]: residual <- x + residual
    (in place) and the norm is taken of that sum. Rows must be contiguous."""
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [T, H] and weight [H], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x {tuple(x.shape)} {x.dtype}")
    check_last_dim_contiguous("x", x)
    out = torch.empty_like(x)
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return out
    block = next_power_of_2(hidden)
    res = residual if residual is not None else x
    check_last_dim_contiguous("residual", res)
    _rms_norm_kernel[(num_tokens,)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), eps,
        HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None,
        num_warps=8 if block >= 4096 else 4, **pdl_launch(x.device),
    )
    return out
