"""Copy a head range of KV block runs from one block pool to another, every layer in one launch:
the device side of a handoff (a mapped peer pool into the own pool) and the local half of a
reshard (packing a staging buffer, or cutting a pool's heads out of one).

    src [2, Ps, Hs, BS, D] per layer   dst [2, Pd, Hd, BS, D] per layer
    runs int32 [R, 3]: (src_block, dst_block, num_blocks)

    for each run, j < num_blocks, kv in {K, V}, every layer:
        dst[kv, dst_block + j, dh0 : dh0 + nh] = src[kv, src_block + j, sh0 : sh0 + nh]

Within one (kv, block) a head range is one contiguous row of nh * BS * D elements on both sides
(the heads of a block are adjacent). Grid (runs, cdiv(longest run, ROWS), 2 * layers): a program
copies a [ROWS, row] tile — ROWS consecutive blocks of one run — in CHUNK-wide column steps.

Why runs and not one id per block: a prompt's blocks mostly come in long runs, and a run table
of a few rows is what the host builds and copies per handoff (a list of 512 ids cost ~40-100 µs
of host time at 8k tokens on the H200, against ~140 µs for the copy itself). Why ROWS x CHUNK
tiles with 8 warps: on the H200 this reached 86-92% of a same-size device memcpy at 8k-32k tokens
in GPU time, against ~80% for one 16 KiB row per program (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, layer_offsets, next_power_of_2
from .pack_reference import copy_head_blocks_reference

__all__ = ["copy_head_block_runs", "copy_head_blocks", "copy_head_blocks_layers", "copy_head_blocks_reference"]

_MAX_CHUNK = 1024
_MAX_ROWS = 4


@triton.jit
def _copy_runs_kernel(
    src_ptr,
    dst_ptr,
    src_layer_offsets_ptr,
    dst_layer_offsets_ptr,
    runs_ptr,
    stride_src_kv,
    stride_src_blk,
    stride_dst_kv,
    stride_dst_blk,
    src_head_offset,
    dst_head_offset,
    ROW: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Axis 2 is layer * 2 + kv; a layer's tensors sit at an element offset from the first
    layer's (same shapes and strides), so one launch serves every layer."""
    run = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(2).to(tl.int64) // 2
    kv = tl.program_id(2).to(tl.int64) % 2
    s0 = tl.load(runs_ptr + run * 3).to(tl.int64)
    d0 = tl.load(runs_ptr + run * 3 + 1).to(tl.int64)
    length = tl.load(runs_ptr + run * 3 + 2)
    j = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    rows = j < length
    # multiples of 16 elements (checked on the host): keeps the loads vectorised
    src_row = (tl.multiple_of(tl.load(src_layer_offsets_ptr + layer), 16) + kv * stride_src_kv
               + (s0 + j.to(tl.int64)) * stride_src_blk + src_head_offset)
    dst_row = (tl.multiple_of(tl.load(dst_layer_offsets_ptr + layer), 16) + kv * stride_dst_kv
               + (d0 + j.to(tl.int64)) * stride_dst_blk + dst_head_offset)
    for c in tl.static_range(0, ROW, CHUNK):
        cols = c + tl.arange(0, CHUNK)
        mask = rows[:, None] & (cols < ROW)[None, :]
        x = tl.load(src_ptr + src_row[:, None] + cols[None, :], mask=mask)
        tl.store(dst_ptr + dst_row[:, None] + cols[None, :], x, mask=mask)


def _check(name: str, t: torch.Tensor) -> None:
    if t.dim() != 5 or t.shape[0] != 2:
        raise ValueError(f"{name} must be [2, blocks, heads, block_size, head_dim], got {tuple(t.shape)}")
    if t.stride(4) != 1 or t.stride(3) != t.shape[4] or t.stride(2) != t.shape[3] * t.shape[4]:
        raise ValueError(f"{name}'s heads x block_size x head_dim must be contiguous, strides {t.stride()}")


def _check_layers(srcs, dsts, src_head_start: int, dst_head_start: int, num_heads: int) -> None:
    """Checks the first layer of each side; `layer_offsets` checks that the others match it."""
    if len(srcs) != len(dsts) or not srcs:
        raise ValueError(f"{len(srcs)} source and {len(dsts)} destination layers")
    src, dst = srcs[0], dsts[0]
    _check("src", src)
    _check("dst", dst)
    if src.dtype != dst.dtype or src.device != dst.device or src.shape[3:] != dst.shape[3:]:
        raise ValueError(f"src {tuple(src.shape)} {src.dtype} {src.device} and dst {tuple(dst.shape)} {dst.dtype} "
                         f"{dst.device} must agree on dtype, device, block_size and head_dim")
    if not (0 <= src_head_start and src_head_start + num_heads <= src.shape[2] and 0 <= dst_head_start
            and dst_head_start + num_heads <= dst.shape[2] and num_heads >= 1):
        raise ValueError(f"heads [{src_head_start}, +{num_heads}) of {src.shape[2]} -> "
                         f"[{dst_head_start}, +{num_heads}) of {dst.shape[2]} out of range")


def copy_head_block_runs(
    srcs, dsts, runs: torch.Tensor, max_run: int, src_head_start: int, dst_head_start: int, num_heads: int,
) -> None:
    """Copy the head range of every block run of `runs` (int32 [R, 3] on the devices: src_block,
    dst_block, num_blocks; `max_run` >= the longest) for every (src, dst) layer pair, in one
    launch. All `srcs` share one shape / strides / dtype, all `dsts` another (a KV pool's layers
    do). Block ids are not range-checked on the device: the transfer plan guarantees them."""
    _check_layers(srcs, dsts, src_head_start, dst_head_start, num_heads)
    if runs.dim() != 2 or runs.shape[1] != 3 or runs.dtype != torch.int32:
        raise ValueError(f"runs must be int32 [R, 3], got {runs.dtype} {tuple(runs.shape)}")
    if runs.shape[0] == 0 or max_run <= 0:
        return
    first_src, first_dst = srcs[0], dsts[0]
    device = first_dst.device
    head = first_src.shape[3] * first_src.shape[4]
    row = num_heads * head
    rows = min(next_power_of_2(max_run), _MAX_ROWS)
    _copy_runs_kernel[(runs.shape[0], cdiv(max_run, rows), 2 * len(srcs))](
        first_src, first_dst, layer_offsets(srcs, device), layer_offsets(dsts, device), runs,
        first_src.stride(0), first_src.stride(1), first_dst.stride(0), first_dst.stride(1),
        src_head_start * head, dst_head_start * head,
        ROW=row, ROWS=rows, CHUNK=min(next_power_of_2(row), _MAX_CHUNK), num_warps=8,
    )


def copy_head_blocks_layers(
    srcs, dsts, src_ids: torch.Tensor, dst_ids: torch.Tensor, src_head_start: int, dst_head_start: int,
    num_heads: int,
) -> None:
    """`copy_head_blocks` for every (src, dst) layer pair in one launch (block ids one by one)."""
    if src_ids.shape != dst_ids.shape or src_ids.dim() != 1:
        raise ValueError(f"src_ids {tuple(src_ids.shape)} and dst_ids {tuple(dst_ids.shape)} must be equal 1-D")
    ones = torch.ones_like(src_ids, dtype=torch.int32)
    runs = torch.stack([src_ids.to(torch.int32), dst_ids.to(torch.int32), ones], dim=1)
    copy_head_block_runs(srcs, dsts, runs, 1, src_head_start, dst_head_start, num_heads)


def copy_head_blocks(
    src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor,
    src_head_start: int, dst_head_start: int, num_heads: int,
) -> None:
    """Triton version of `copy_head_blocks_reference` (same arguments, same result)."""
    copy_head_blocks_layers([src], [dst], src_ids, dst_ids, src_head_start, dst_head_start, num_heads)
