"""NIXL reshard pulls through a staging buffer: read whole source blocks (all the source rank's
heads) in a few large regions, then cut the wanted head range out locally.

A reshard op that takes some of a source rank's heads is strided on the source: one region per
(layer, K|V, block), ~65k UCX requests of 8 KiB for a 32k-token prompt, which UCX serves at a
fraction of memory speed. Reading all heads makes every block run one region — at most twice
the bytes when the op takes at least half of the heads (`should_stage`) — and one strided local
copy (`local_copy.copy_op`) keeps the wanted heads::

    staging unit u = one (op, layer):  [2, num_blocks, src heads, block_size, head_dim]
                                        blocks in op order: staging block k = op block k
    chunk = units up to CHUNK_BYTES;   two registered buffers: read chunk k+1 while chunk k
                                        is cut into the destination pool
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from splitserve.engine.transfer.layout import KVLayout
from splitserve.engine.transfer.local_copy import copy_op
from splitserve.engine.transfer.plan import BlockRun, TransferOp
from splitserve.engine.transfer.regions import Regions, ops_regions

CHUNK_BYTES = 64 << 20
"""Staging bytes read per NIXL request (two such buffers per transport, grown to one unit if larger)."""


def should_stage(op: TransferOp, src: KVLayout) -> bool:
    """Strided on the source (a head slice) yet at least half its heads: reading whole blocks
    costs at most 2x the bytes and saves one region per (layer, K|V, block)."""
    return op.num_heads < src.num_local_heads and 2 * op.num_heads >= src.num_local_heads


@dataclass(frozen=True)
class Unit:
    op: TransferOp
    layer: int
    """Relative to the op."""


def _unit_bytes(op: TransferOp, src: KVLayout) -> int:
    return 2 * op.num_blocks * src.num_local_heads * src.head_block_bytes


def chunks(ops: Sequence[TransferOp], src: KVLayout) -> list[list[Unit]]:
    """Staging units of `ops`, grouped into chunks of at most CHUNK_BYTES (at least one unit)."""
    out: list[list[Unit]] = []
    size = 0
    for op in ops:
        for i in range(op.num_layers):
            if not out or size + _unit_bytes(op, src) > CHUNK_BYTES:
                out.append([])
                size = 0
            out[-1].append(Unit(op, i))
            size += _unit_bytes(op, src)
    return out


def chunk_regions(chunk: Sequence[Unit], src: KVLayout, src_pool: int) -> tuple[Regions, np.ndarray]:
    """Regions reading `chunk` whole-head into staging; dst_layer indexes the unit, and the second
    array gives each unit's byte offset in the staging buffer."""
    staged, offsets, offset = [], [], 0
    for u, unit in enumerate(chunk):
        op = unit.op
        runs, k = [], 0
        for run in op.block_runs:
            runs.append(BlockRun(run.src_block, k, run.num_blocks))
            k += run.num_blocks
        staged.append(TransferOp(
            src_rank=op.src_rank, dst_rank=op.dst_rank, layer_start=op.layer_start + unit.layer, num_layers=1,
            src_layer_start=op.src_layer_start + unit.layer, dst_layer_start=u, src_head_start=0,
            dst_head_start=0, num_heads=src.num_local_heads, block_runs=tuple(runs)))
        offsets.append(offset)
        offset += _unit_bytes(op, src)
    # Each unit is its own [2, nb, H, bs, hd] tensor: addressed with the unit's own block count.
    parts = [ops_regions([s], src, src, src_pool, s.num_blocks) for s in staged]
    return Regions.concat(parts), np.asarray(offsets, dtype=np.int64)


def unpack(chunk: Sequence[Unit], buffer: torch.Tensor, offsets: np.ndarray, src: KVLayout,
           kv_tensors: Sequence[torch.Tensor]) -> None:
    """Cut each staged unit's wanted heads into the destination pool."""
    dtype = kv_tensors[0].dtype
    for unit, offset in zip(chunk, offsets.tolist(), strict=True):
        op = unit.op
        nbytes = _unit_bytes(op, src)
        shape = (2, op.num_blocks, src.num_local_heads, src.block_size, src.head_dim)
        staged = buffer[offset: offset + nbytes].view(dtype).view(shape)
        runs, k = [], 0
        for run in op.block_runs:
            runs.append(BlockRun(k, run.dst_block, run.num_blocks))
            k += run.num_blocks
        one = TransferOp(
            src_rank=op.src_rank, dst_rank=op.dst_rank, layer_start=op.layer_start + unit.layer, num_layers=1,
            src_layer_start=0, dst_layer_start=op.dst_layer_start + unit.layer, src_head_start=op.src_head_start,
            dst_head_start=op.dst_head_start, num_heads=op.num_heads, block_runs=tuple(runs))
        copy_op(one, [staged], kv_tensors)


def staged_pull(
    ops: Sequence[TransferOp], src: KVLayout, src_pool: int, buffers: Callable[[int], list[torch.Tensor]],
    post: Callable[[Regions, np.ndarray, torch.Tensor], object], wait: Callable[[object], None],
    kv_tensors: Sequence[torch.Tensor],
) -> tuple[int, int]:
    """Read `ops` (one source rank) through two staging buffers, overlapping the read of chunk
    k+1 with the cut of chunk k. `buffers(nbytes)` returns the two registered uint8 buffers of at
    least `nbytes`; `post(regions, unit_offsets, buffer)` starts a READ into `buffer` and returns a
    handle; `wait(handle)` blocks until it is done (and releases it). Returns (bytes delivered to
    the destination — the plan's, not the larger amount read — and regions read)."""
    plan = chunks(ops, src)
    if not plan:
        return 0, 0
    need = max(sum(_unit_bytes(u.op, src) for u in c) for c in plan)
    bufs = buffers(need)
    prepared = [chunk_regions(c, src, src_pool) for c in plan]
    num_bytes = sum(op.num_layers * 2 * op.num_blocks * op.num_heads * src.head_block_bytes for op in ops)
    num_regions = sum(len(r) for r, _ in prepared)
    # On a GPU the cut is asynchronous: a buffer is read into again only once the stream has
    # finished the cut that read it, and the pull returns with the data in place.
    stream = torch.cuda.current_stream(kv_tensors[0].device) if kv_tensors[0].is_cuda else None
    handle = post(*prepared[0], bufs[0])
    for k, chunk in enumerate(plan):
        wait(handle)
        if k + 1 < len(plan):
            if stream is not None and k >= 1:
                stream.synchronize()  # the cut of chunk k - 1 read bufs[(k + 1) % 2]
            handle = post(*prepared[k + 1], bufs[(k + 1) % 2])
        unpack(chunk, bufs[k % 2], prepared[k][1], src, kv_tensors)
    if stream is not None:
        stream.synchronize()
    return num_bytes, num_regions
