"""Copy a head range of gathered KV blocks from one block pool to another: the local half of a
reshard — packing a staging buffer from a pool, or cutting a pool's heads out of one.

    src [2, Ps, Hs, BS, D]   dst [2, Pd, Hd, BS, D]   src_ids, dst_ids [n]

    for i < n, kv in {K, V}:
        dst[kv, dst_ids[i], dh0 : dh0 + nh] = src[kv, src_ids[i], sh0 : sh0 + nh]

Within one (kv, block) a head range is one contiguous row of nh * BS * D elements on both sides
(the heads of a block are adjacent), so each program copies one chunk of one such row:
grid (n, 2 * layers, cdiv(row, CHUNK)) — every layer of an op in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, next_power_of_2
from .pack_reference import copy_head_blocks_reference

__all__ = ["copy_head_blocks", "copy_head_blocks_layers", "copy_head_blocks_reference"]

_MAX_CHUNK = 4096


@triton.jit
def _copy_head_blocks_kernel(
    src_ptr,
    dst_ptr,
    src_layer_offsets_ptr,
    dst_layer_offsets_ptr,
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
    """Axis 1 is layer * 2 + kv; a layer's tensors sit at an element offset from the first
    layer's (same shapes and strides), so one launch serves every layer of an op."""
    i = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64) // 2
    kv = tl.program_id(1).to(tl.int64) % 2
    offs = tl.program_id(2).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < ROW
    s = tl.load(src_ids_ptr + i).to(tl.int64)
    d = tl.load(dst_ids_ptr + i).to(tl.int64)
    # multiples of 16 elements (checked on the host): keeps the loads vectorised, as with the
    # specialised integer arguments of the per-layer kernel
    src_base = src_ptr + tl.multiple_of(tl.load(src_layer_offsets_ptr + layer), 16)
    dst_base = dst_ptr + tl.multiple_of(tl.load(dst_layer_offsets_ptr + layer), 16)
    x = tl.load(src_base + kv * stride_src_kv + s * stride_src_blk + src_head_offset + offs, mask=mask)
    tl.store(dst_base + kv * stride_dst_kv + d * stride_dst_blk + dst_head_offset + offs, x, mask=mask)


def _check(name: str, t: torch.Tensor) -> None:
    if t.dim() != 5 or t.shape[0] != 2:
        raise ValueError(f"{name} must be [2, blocks, heads, block_size, head_dim], got {tuple(t.shape)}")
    if t.stride(4) != 1 or t.stride(3) != t.shape[4] or t.stride(2) != t.shape[3] * t.shape[4]:
        raise ValueError(f"{name}'s heads x block_size x head_dim must be contiguous, strides {t.stride()}")


def _validate(src, dst, src_ids, dst_ids, src_head_start: int, dst_head_start: int, num_heads: int) -> None:
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


def copy_head_blocks(
    src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor,
    src_head_start: int, dst_head_start: int, num_heads: int,
) -> None:
    """Triton version of `copy_head_blocks_reference` (same arguments, same result)."""
    copy_head_blocks_layers([src], [dst], src_ids, dst_ids, src_head_start, dst_head_start, num_heads)


def _layer_offsets(tensors, device: torch.device) -> torch.Tensor:
    """Element offsets of each layer's tensor from the first one's (one address space)."""
    base, size = tensors[0].data_ptr(), tensors[0].element_size()
    deltas = [t.data_ptr() - base for t in tensors]
    if any(d % (16 * size) for d in deltas):
        raise ValueError("layer tensors are not 16-element aligned to each other")
    return torch.tensor([d // size for d in deltas], dtype=torch.int64).to(device, non_blocking=True)


def copy_head_blocks_layers(
    srcs, dsts, src_ids: torch.Tensor, dst_ids: torch.Tensor, src_head_start: int, dst_head_start: int,
    num_heads: int,
) -> None:
    """`copy_head_blocks` for every (src, dst) layer pair in one launch: all `srcs` share one
    shape / stride / dtype, all `dsts` another (a KV pool's layers do), on one device."""
    if len(srcs) != len(dsts) or not srcs:
        raise ValueError(f"{len(srcs)} source and {len(dsts)} destination layers")
    first_src, first_dst = srcs[0], dsts[0]
    for name, group in (("src", srcs), ("dst", dsts)):
        for t in group:
            _check(name, t)
            if t.shape != group[0].shape or t.stride() != group[0].stride() or t.dtype != group[0].dtype \
                    or t.device != group[0].device:
                raise ValueError(f"every {name} layer must have the first one's shape, strides, dtype and device")
    _validate(first_src, first_dst, src_ids, dst_ids, src_head_start, dst_head_start, num_heads)
    n = src_ids.shape[0]
    if n == 0:
        return
    device = first_dst.device
    head = first_src.shape[3] * first_src.shape[4]
    row = num_heads * head
    chunk = min(next_power_of_2(row), _MAX_CHUNK)
    _copy_head_blocks_kernel[(n, 2 * len(srcs), cdiv(row, chunk))](
        first_src, first_dst, _layer_offsets(srcs, device), _layer_offsets(dsts, device), src_ids, dst_ids,
        first_src.stride(0), first_src.stride(1), first_dst.stride(0), first_dst.stride(1),
        src_head_start * head, dst_head_start * head,
        ROW=row, CHUNK=chunk,
    )
