"""Copy a head range of gathered KV blocks from one block pool to another: the local half of a
reshard — packing a staging buffer from a pool, or cutting a pool's heads out of one.

    src [2, Ps, Hs, BS, D]   dst [2, Pd, Hd, BS, D]   src_ids, dst_ids [n]

    for i < n, kv in {K, V}:
        dst[kv, dst_ids[i], dh0 : dh0 + nh] = src[kv, src_ids[i], sh0 : sh0 + nh]

Within one (kv, block) a head range is one contiguous row of nh * BS * D elements on both sides
(the heads of a block are adjacent), so each program copies one chunk of one such row:
grid (n, 2, cdiv(row, CHUNK)). Block ids are data, not shapes: the launch is graph-capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, next_power_of_2
from .pack_reference import copy_head_blocks_reference

__all__ = ["copy_head_blocks", "copy_head_blocks_reference"]

_MAX_CHUNK = 4096


@triton.jit
def _copy_head_blocks_kernel(
    src_ptr,
    dst_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    stride_src_kv,
    stride_src_blk,
    stride_dst_kv,
    stride_dst_blk,
    src_head_offset,
    dst_head_offset,
    ROW: tl.constexpr,
    CHUNK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(2).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < ROW
    s = tl.load(src_ids_ptr + i).to(tl.int64)
    d = tl.load(dst_ids_ptr + i).to(tl.int64)
    x = tl.load(src_ptr + kv * stride_src_kv + s * stride_src_blk + src_head_offset + offs, mask=mask)
    tl.store(dst_ptr + kv * stride_dst_kv + d * stride_dst_blk + dst_head_offset + offs, x, mask=mask)


def _check(name: str, t: torch.Tensor) -> None:
    if t.dim() != 5 or t.shape[0] != 2:
        raise ValueError(f"{name} must be [2, blocks, heads, block_size, head_dim], got {tuple(t.shape)}")
    if t.stride(4) != 1 or t.stride(3) != t.shape[4] or t.stride(2) != t.shape[3] * t.shape[4]:
        raise ValueError(f"{name}'s heads x block_size x head_dim must be contiguous, strides {t.stride()}")


def copy_head_blocks(
    src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor,
    src_head_start: int, dst_head_start: int, num_heads: int,
) -> None:
    """Triton version of `copy_head_blocks_reference` (same arguments, same result)."""
    _check("src", src)
    _check("dst", dst)
    if src.dtype != dst.dtype or src.device != dst.device or src.shape[3:] != dst.shape[3:]:
        raise ValueError(f"src {tuple(src.shape)} {src.dtype} {src.device} and dst {tuple(dst.shape)} {dst.dtype} "
                         f"{dst.device} must agree on dtype, device, block_size and head_dim")
    if src_ids.shape != dst_ids.shape or src_ids.dim() != 1:
        raise ValueError(f"src_ids {tuple(src_ids.shape)} and dst_ids {tuple(dst_ids.shape)} must be equal 1-D")
    if not (0 <= src_head_start and src_head_start + num_heads <= src.shape[2] and 0 <= dst_head_start
            and dst_head_start + num_heads <= dst.shape[2] and num_heads >= 1):
        raise ValueError(f"heads [{src_head_start}, +{num_heads}) of {src.shape[2]} -> "
                         f"[{dst_head_start}, +{num_heads}) of {dst.shape[2]} out of range")
    n = src_ids.shape[0]
    if n == 0:
        return
    head = src.shape[3] * src.shape[4]
    row = num_heads * head
    chunk = min(next_power_of_2(row), _MAX_CHUNK)
    _copy_head_blocks_kernel[(n, 2, cdiv(row, chunk))](
        src, dst, src_ids, dst_ids,
        src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
        src_head_start * head, dst_head_start * head,
        ROW=row, CHUNK=chunk,
    )
