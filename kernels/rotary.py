"""Rotary position embedding of q and k in place, one launch for both.

    x [T, H, D], cos / sin [T, D]  (rotate_half convention, cos = cat(c, c))
    x[:, :, :D/2] <- x1 * cos1 - x2 * sin1
    x[:, :, D/2:] <- x2 * cos2 + x1 * sin2

Each product and the sum are rounded to the activation dtype as the unfused
`x * cos + rotate_half(x) * sin` rounds them, so fp32 is bit-exact and half
precision matches to the same roundings. q and k may be strided views (slices
of a fused qkv projection) with a contiguous head_dim. Program (t, 0) rotates
token t's q heads, program (t, 1) its k heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_last_dim_contiguous, next_power_of_2
from .elementwise_reference import rotary_reference

__all__ = ["apply_rotary_qk", "rotary_reference"]


@triton.jit
def _rotate(x_ptr, stride_t, stride_h, cos_ptr, sin_ptr, t, num_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < num_heads)[:, None]
    base = x_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    c1 = tl.load(cos_ptr + offs_d).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + HALF + offs_d).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + offs_d).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + HALF + offs_d).to(tl.float32)[None, :]
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    lo = (a1 * c1).to(dtype).to(tl.float32) + (-a2 * s1).to(dtype).to(tl.float32)
    hi = (a2 * c2).to(dtype).to(tl.float32) + (a1 * s2).to(dtype).to(tl.float32)
    tl.store(base, lo.to(dtype), mask=mask)
    tl.store(base + HALF, hi.to(dtype), mask=mask)


@triton.jit
def _rotary_qk_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_cs,
    num_q_heads, num_k_heads,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)
    cos = cos_ptr + t * stride_cs
    sin = sin_ptr + t * stride_cs
    if which == 0:
        _rotate(q_ptr, stride_q_t, stride_q_h, cos, sin, t, num_q_heads, HALF, BLOCK_HQ)
    else:
        _rotate(k_ptr, stride_k_t, stride_k_h, cos, sin, t, num_k_heads, HALF, BLOCK_HK)


def apply_rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place: q [T, Hq, D], k [T, Hk, D]; cos / sin [T, D] contiguous rows, same dtype
    as q and k. head_dim must be a power of two (every Llama / Qwen2 size is)."""
    num_tokens, num_q, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or cos.shape != (num_tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)} do not fit")
    if head_dim % 2 or next_power_of_2(head_dim) != head_dim:
        raise ValueError(f"head_dim {head_dim} must be an even power of two")
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_last_dim_contiguous(name, t)
    if cos.stride(0) != sin.stride(0):
        raise ValueError("cos and sin must share a row stride")
    if num_tokens == 0:
        return
    _rotary_qk_kernel[(num_tokens, 2)](
        q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        num_q, k.shape[1],
        HALF=head_dim // 2, BLOCK_HQ=next_power_of_2(num_q), BLOCK_HK=next_power_of_2(k.shape[1]),
        num_warps=4,
    )
