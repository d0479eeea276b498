"""Copy a head range of KV block runs from one block pool to another, every layer in one launch:
the device side of a handoff (a mapped peer pool into the own pool) and the local half of a
reshard (packing a staging buffer, or cutting a pool's heads out of one).

    src [2, Ps, Hs, BS, D] per layer   dst [2, Pd, Hd, BS, D] per layer
    runs int32 [R, 3]: (src_block, dst_block, num_blocks), or one run as three scalars

    for each run, j < num_blocks, kv in {K, V}, every layer:
        dst[kv, dst_block + j, dh0 : dh0 + nh] = src[kv, src_block + j, sh0 : sh0 + nh]

Within one (kv, block) a head range is one contiguous row of nh * BS * D elements on both sides
(the heads of a block are adjacent). Grid (runs, cdiv(longest run, ROWS), 2 * layers): a program
copies a [ROWS, row] tile — ROWS consecutive blocks of one run — in CHUNK-wide column steps.

Why runs and not one id per block: a prompt's blocks mostly come in long runs, and a run table
of a few rows is what the host builds and copies per handoff (a list of 512 ids cost ~40-100 µs
of host time at 8k tokens on the H200, against ~140 µs for the copy itself); one run goes as three
scalars, with no table at all. Why 2 x 2048 tiles with 16 warps: best or within 1% of the best of a
60-configuration sweep on the H200 at 1k and 8k tokens, whole blocks and half the heads: 94-98% of a
same-size device memcpy in GPU time, where the earlier 8 x 2048 tiles gave 90-97% (benchmarks/RESULTS.md,
2026-12-04 session 16). Host time is the rest of a handoff's cost, so the per-pool work (checks,
layer offsets, specialisation keys) is cached in `_pair` and the launch skips Triton's per-call
binding (`_launch.FastLaunch`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, layer_offsets, next_power_of_2
from ._launch import FastLaunch, arg_key
from .pack_reference import copy_head_blocks_reference

__all__ = ["NUM_WARPS", "copy_grid", "copy_head_block_runs", "copy_head_blocks_reference"]

_MAX_CHUNK = 2048
_MAX_ROWS = 2
NUM_WARPS = 16


@triton.jit(do_not_specialize=["one_src", "one_dst", "one_len"])  # a block id of 1 stays a runtime int
def _copy_runs_kernel(
    src_ptr,
    dst_ptr,
    src_layer_offsets_ptr,
    dst_layer_offsets_ptr,
    stride_src_kv,
    stride_src_blk,
    stride_dst_kv,
    stride_dst_blk,
    src_head_offset,
    dst_head_offset,
    runs_ptr,
    one_src,
    one_dst,
    one_len,
    ROW: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
    ONE_RUN: tl.constexpr,
):
    """Axis 2 is layer * 2 + kv; a layer's tensors sit at an element offset from the first
    layer's (same shapes and strides), so one launch serves every layer. ONE_RUN: the single
    run comes as the scalars one_* and `runs_ptr` is not read."""
    run = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(2).to(tl.int64) // 2
    kv = tl.program_id(2).to(tl.int64) % 2
    if ONE_RUN:
        s0 = one_src.to(tl.int64)
        d0 = one_dst.to(tl.int64)
        length = one_len
    else:
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


_launch_copy_runs = FastLaunch(_copy_runs_kernel)


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


_PAIRS: dict[tuple, tuple] = {}
_DATA_PTR = torch.Tensor.data_ptr
_MAX_PAIRS = 64


def pair_key(srcs, dsts, src_head_start: int, dst_head_start: int, num_heads: int) -> tuple:
    """Every layer's address on both sides, the first layers' shapes and strides, the heads:
    equal keys name the same memory laid out the same way (while the tensors are alive)."""
    return (tuple(map(_DATA_PTR, srcs)), tuple(map(_DATA_PTR, dsts)), srcs[0].shape, dsts[0].shape,
            srcs[0].stride(), dsts[0].stride(), src_head_start, dst_head_start, num_heads)


def _pair(srcs, dsts, src_head_start: int, dst_head_start: int, num_heads: int) -> tuple:
    """The launch arguments that depend on the two pools and the head range only — checked and
    built once per (source pool, destination pool, heads): a handoff pulls from the same mapped
    peer pool into the same own pool again and again, and the checks, layer offsets and
    specialisation keys cost ~15 µs of a ~140 µs 8k-token copy on the H200 host."""
    key = pair_key(srcs, dsts, src_head_start, dst_head_start, num_heads)
    pair = _PAIRS.get(key)
    if pair is None:
        _check_layers(srcs, dsts, src_head_start, dst_head_start, num_heads)
        first_src, first_dst = srcs[0], dsts[0]
        device = first_dst.device
        head = first_src.shape[3] * first_src.shape[4]
        src_offsets, dst_offsets = layer_offsets(srcs, device), layer_offsets(dsts, device)
        scalars = (first_src.stride(0), first_src.stride(1), first_dst.stride(0), first_dst.stride(1),
                   src_head_start * head, dst_head_start * head)
        static_key = (device.index, *map(arg_key, (first_src, first_dst, src_offsets, dst_offsets) + scalars))
        if len(_PAIRS) >= _MAX_PAIRS:
            _PAIRS.clear()
        # no pool tensor is kept (a peer's mapped pool must be free to go): the key has their addresses
        pair = _PAIRS[key] = (src_offsets, dst_offsets, scalars, static_key, num_heads * head)
    return pair


def copy_head_block_runs(
    srcs, dsts, runs, max_run: int, src_head_start: int, dst_head_start: int, num_heads: int,
    grid_blocks: int | None = None,
) -> None:
    """Copy the head range of every block run of `runs` for every (src, dst) layer pair, in one
    launch. `runs` is an int32 [R, 3] tensor on the devices (src_block, dst_block, num_blocks;
    `max_run` >= the longest), or one such run as a tuple of ints — passed to the kernel as
    scalars, with no host-to-device copy (~13 µs of a ~140 µs 8k-token handoff on the H200).
    `grid_blocks` (one run only): size the launch for runs of up to that many blocks instead of
    this run's length — a captured graph whose scalars are rewritten per launch
    (engine/transfer/graph_node.py); the caller keeps every run's length within it.
    All `srcs` share one shape / strides / dtype, all `dsts` another (a KV pool's layers do).
    Block ids are not range-checked on the device: the transfer plan guarantees them."""
    if len(srcs) != len(dsts) or not srcs:
        raise ValueError(f"{len(srcs)} source and {len(dsts)} destination layers")
    src_offsets, dst_offsets, scalars, static_key, row = _pair(srcs, dsts, src_head_start, dst_head_start, num_heads)
    if isinstance(runs, tuple):
        if len(runs) != 3 or not all(isinstance(x, int) and x >= 0 for x in runs):
            raise ValueError(f"one run must be (src_block, dst_block, num_blocks) ints >= 0, got {runs!r}")
        max_run = runs[2] if grid_blocks is None else grid_blocks
        one, num_runs, table = runs, 1, src_offsets  # the table is not read
    else:
        if runs.dim() != 2 or runs.shape[1] != 3 or runs.dtype != torch.int32:
            raise ValueError(f"runs must be int32 [R, 3], got {runs.dtype} {tuple(runs.shape)}")
        one, num_runs, table = (0, 0, 0), runs.shape[0], runs
    if num_runs == 0 or max_run <= 0:
        return
    _launch_copy_runs(
        copy_grid(num_runs, max_run, len(srcs)),
        (srcs[0], dsts[0], src_offsets, dst_offsets, *scalars, table, *one),
        {"ROW": row, "ROWS": _rows(max_run), "CHUNK": min(next_power_of_2(row), _MAX_CHUNK), "ONE_RUN": isinstance(runs, tuple)},
        NUM_WARPS, static_key=static_key, num_static=4 + len(scalars),
    )


def _rows(max_run: int) -> int:
    return min(next_power_of_2(max_run), _MAX_ROWS)


def copy_grid(num_runs: int, max_run: int, num_layers: int) -> tuple[int, int, int]:
    """The launch grid of `copy_head_block_runs` (its kernel runs `NUM_WARPS` warps a program)."""
    return (num_runs, cdiv(max_run, _rows(max_run)), 2 * num_layers)
