"""Scatter new tokens' K/V into the paged cache.

    kv [2, NB, Hkv, BS, D], k / v [T, Hkv, D], slot_mapping [T]

    slot = block * BS + offset  ->  kv[0, block, :, offset, :] = k[t]
                                    kv[1, block, :, offset, :] = v[t]

One program per token moves its [Hkv, D] rows of K and V; a negative slot
(a padding token of a CUDA-graph batch) is skipped. k / v may be strided views
(e.g. slices of a fused qkv projection) as long as head_dim is contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_kv, check_last_dim_contiguous, next_power_of_2
from .reference import write_kv_reference

__all__ = ["write_kv", "write_kv_reference"]


@triton.jit
def _write_kv_kernel(
    kv_ptr,
    k_ptr,
    v_ptr,
    slot_mapping_ptr,
    stride_kv_kv,
    stride_kv_blk,
    stride_kv_h,
    stride_kv_tok,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    dst = (
        kv_ptr
        + (slot // PAGE_SIZE) * stride_kv_blk
        + (slot % PAGE_SIZE) * stride_kv_tok
        + offs_h[:, None] * stride_kv_h
        + offs_d[None, :]
    )
    k = tl.load(k_ptr + t * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :], mask=mask)
    tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kv_kv, v.to(kv_ptr.dtype.element_ty), mask=mask)


def write_kv(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """In place: kv [2, NB, Hkv, BS, D] <- k, v [T, Hkv, D] at slot_mapping [T] (int32/int64;
    negative = skip). k / v are cast to kv.dtype; head_dim must be contiguous everywhere."""
    num_tokens, num_heads, head_dim = k.shape
    check_kv(kv, head_dim)
    if v.shape != k.shape or kv.shape[2] != num_heads or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"k {tuple(k.shape)}, v {tuple(v.shape)}, slot_mapping {tuple(slot_mapping.shape)} "
            f"do not fit kv {tuple(kv.shape)}"
        )
    check_last_dim_contiguous("k", k)
    check_last_dim_contiguous("v", v)
    if num_tokens == 0:
        return
    block_h = next_power_of_2(num_heads)
    block_d = next_power_of_2(head_dim)
    _write_kv_kernel[(num_tokens,)](
        kv,
        k,
        v,
        slot_mapping,
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        kv.stride(3),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        PAGE_SIZE=kv.shape[3],
        num_warps=4 if block_h * block_d >= 1024 else 2,
    )
