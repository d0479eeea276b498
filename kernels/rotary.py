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

from ._common import check_kv, check_last_dim_contiguous, next_power_of_2
from ._pdl import pdl_launch, wait_for_producer
from .elementwise_reference import rotary_reference

__all__ = ["apply_rotary_qk", "apply_rotary_qk_and_write_kv", "rotary_reference"]


@triton.jit
def _rotate(x_ptr, stride_t, stride_h, cos_ptr, sin_ptr, t, num_heads,
            HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    mask = (offs_h < num_heads)[:, None] & mask_d[None, :]
    base = x_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    c1 = tl.load(cos_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    lo = (a1 * c1).to(dtype).to(tl.float32) + (-a2 * s1).to(dtype).to(tl.float32)
    hi = (a2 * c2).to(dtype).to(tl.float32) + (a1 * s2).to(dtype).to(tl.float32)
    tl.store(base, lo.to(dtype), mask=mask)
    tl.store(base + HALF, hi.to(dtype), mask=mask)
    return lo.to(dtype), hi.to(dtype)


@triton.jit
def _cache_rows(kv_ptr, slot, stride_kv_blk, stride_kv_h, stride_kv_tok, num_heads,
                WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_H: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Pointers [BLOCK_H, BLOCK_W] to the first WIDTH dims of each head at `slot`, and their mask."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_W)
    base = kv_ptr + (slot // PAGE_SIZE) * stride_kv_blk + (slot % PAGE_SIZE) * stride_kv_tok
    mask = (offs_h < num_heads)[:, None] & (offs_d < WIDTH)[None, :]
    return base + offs_h[:, None] * stride_kv_h + offs_d[None, :], mask


@triton.jit
def _rotary_qk_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kv_ptr, slot_ptr,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_cs,
    stride_kv_kv, stride_kv_blk, stride_kv_h, stride_kv_tok,
    num_q_heads, num_k_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, PAGE_SIZE: tl.constexpr, WRITE_KV: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (t, 0): rotate q. Program (t, 1): rotate k, then (WRITE_KV) write k and v at t's slot."""
    wait_for_producer(PDL)
    t = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)
    cos = cos_ptr + t * stride_cs
    sin = sin_ptr + t * stride_cs
    if which == 0:
        _rotate(q_ptr, stride_q_t, stride_q_h, cos, sin, t, num_q_heads, HALF, BLOCK_HALF, BLOCK_HQ)
    else:
        lo, hi = _rotate(k_ptr, stride_k_t, stride_k_h, cos, sin, t, num_k_heads, HALF, BLOCK_HALF, BLOCK_HK)
        if WRITE_KV:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            if slot >= 0:
                ty = kv_ptr.dtype.element_ty
                dst, mask = _cache_rows(kv_ptr, slot, stride_kv_blk, stride_kv_h, stride_kv_tok, num_k_heads,
                                        HALF, BLOCK_HALF, BLOCK_HK, PAGE_SIZE)
                tl.store(dst, lo.to(ty), mask=mask)
                tl.store(dst + HALF, hi.to(ty), mask=mask)
                dst, mask = _cache_rows(kv_ptr + stride_kv_kv, slot, stride_kv_blk, stride_kv_h, stride_kv_tok,
                                        num_k_heads, 2 * HALF, BLOCK_D, BLOCK_HK, PAGE_SIZE)
                offs_h = tl.arange(0, BLOCK_HK)
                offs_d = tl.arange(0, BLOCK_D)
                v = tl.load(v_ptr + t * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :], mask=mask)
                tl.store(dst, v.to(ty), mask=mask)


def apply_rotary_qk_checks(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    num_tokens, num_q, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or cos.shape != (num_tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)} do not fit")
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even")
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_last_dim_contiguous(name, t)
    if cos.stride(0) != sin.stride(0):
        raise ValueError("cos and sin must share a row stride")


def apply_rotary_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place: q [T, Hq, D], k [T, Hk, D]; cos / sin [T, D] contiguous rows, same dtype
    as q and k; head_dim even (any size: the halves are masked to a power-of-two tile)."""
    apply_rotary_qk_checks(q, k, cos, sin)
    num_tokens, num_q, head_dim = q.shape
    if num_tokens == 0:
        return
    _launch(q, k, k, cos, sin, None, None)


def apply_rotary_qk_and_write_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    kv: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:
    """`apply_rotary_qk(q, k, cos, sin)` and then `write_kv(kv, k, v, slot_mapping)`, in one
    launch: kv [2, NB, Hk, BS, D]; a negative slot (padding row) is not written."""
    apply_rotary_qk_checks(q, k, cos, sin)
    check_kv(kv, q.shape[2])
    if v.shape != k.shape or kv.shape[2] != k.shape[1] or slot_mapping.shape != (q.shape[0],):
        raise ValueError(f"v {tuple(v.shape)}, slot_mapping {tuple(slot_mapping.shape)} do not fit kv {tuple(kv.shape)}")
    check_last_dim_contiguous("v", v)
    num_tokens, num_q, head_dim = q.shape
    if num_tokens == 0:
        return
    _launch(q, k, v, cos, sin, kv, slot_mapping)


def _launch(q, k, v, cos, sin, kv, slot_mapping) -> None:
    """The one launch of both entry points; kv None: rotation only."""
    num_tokens, num_q, head_dim = q.shape
    write = kv is not None
    cache = kv if write else k  # a stand-in, never touched without WRITE_KV
    strides = (kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3)) if write else (0, 0, 0, 0)
    _rotary_qk_kernel[(num_tokens, 2)](
        q, k, v, cos, sin, cache, slot_mapping if write else cos,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        *strides, num_q, k.shape[1],
        HALF=head_dim // 2, BLOCK_HALF=next_power_of_2(head_dim // 2), BLOCK_D=next_power_of_2(head_dim),
        BLOCK_HQ=next_power_of_2(num_q), BLOCK_HK=next_power_of_2(k.shape[1]),
        PAGE_SIZE=kv.shape[3] if write else 1, WRITE_KV=write, num_warps=4,
        **pdl_launch(q.device),
    )
