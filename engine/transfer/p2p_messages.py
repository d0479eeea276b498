"""How torch_dist cuts a (src rank, dst rank) pair's KV into gloo messages on the CPU.

One packed buffer per pair (`pack.py`) moves pack, TCP and unpack in series. Instead:

- **Chunks.** The packed buffer travels in pieces of about `CHUNK_BYTES`, cut at layer boundaries
  (`pair_chunks`), so packing, TCP and unpacking overlap (gloo sends and receives on its own
  threads)::

      src: pack c0 │ pack c1 │ pack c2 │ ...          dst: post every recv, then
                send c0 │ send c1 │ send c2 │ ...             wait c0 │ unpack c0 │ wait c1 │ unpack c1 │ ...

  Both sides cut the same chunks from the plan, and the chunks are consecutive slices of the
  one-buffer layout, so the bytes are the same either way.
- **Runs as messages.** Where an op holds every kv head of a rank (same TP; the destination of a TP
  split; the source of a TP merge; one replicated head), a block run of a layer's K (or V) is one
  contiguous range in that rank's pool: runs of at least `DIRECT_BYTES` travel as their own
  messages (`direct_runs`, `run_messages`), read or written in place on each side that holds
  every head and staged through a copy only on a side that holds a head slice. Same-layout runs
  so skip both staging copies, resharded ones one of them.

- **Layer by layer.** A layer-wise push (`layer_groups(..., by_layer=True)`) cuts a pair's ops into
  one group per source layer, in order, each cut as above, so the source sends layer l as soon as
  it has written it while the destination's receives are already posted.

Every decision reads only the plan, so both sides agree on the messages and their order (group
after group; in a group the runs' first, then the chunks). Measured in benchmarks/RESULTS.md
(2026-12-06, sessions 33-34; layer by layer: 2026-12-07, session 35).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from splitserve.engine.transfer.layout import KVLayout
from splitserve.engine.transfer.pack import op_numel, packed_numel
from splitserve.engine.transfer.plan import BlockRun, TransferOp, layer_slice

CHUNK_BYTES = 4 << 20
"""Target size of a pair's chunks on the CPU (gloo). Measured on this 2-core machine
(benchmarks/RESULTS.md, 2026-12-06 session 33): one buffer per pair moved 1.3-1.8 GB/s, pack, TCP
and unpack in series, where raw TCP over loopback reached 4.3."""

DIRECT_BYTES = 256 << 10
"""Smallest block run (one layer's K or V) sent as its own message on the CPU (gloo): below it a
message's fixed cost outweighs the copies it saves. Measured here (2 processes, one core each,
256 MB in equal messages all posted at once): ~20 us a message; 16 KB messages moved 0.7-0.8
GB/s, 64 KB 1.4-1.7, 256 KB 2.9-3.8, 1-4 MB 2.5-3.9, while packing 256 KB costs ~15-25 us a side."""


def direct_runs(ops: Sequence[TransferOp], src: KVLayout, dst: KVLayout, direct_bytes: int, element_size: int
                ) -> tuple[list[tuple[TransferOp, BlockRun]], list[TransferOp]]:
    """Split a pair's ops into (op, run)s sent as their own messages and the ops left to pack: a
    run goes direct when its op holds every local kv head on at least one side (the run is then
    contiguous in that side's pool) and one layer's K of it is at least `direct_bytes` (`<= 0`:
    none go direct)."""
    if direct_bytes <= 0:
        return [], list(ops)
    direct: list[tuple[TransferOp, BlockRun]] = []
    packed: list[TransferOp] = []
    for op in ops:
        whole = op.num_heads in (src.num_local_heads, dst.num_local_heads)
        run_bytes = op.num_heads * src.block_size * src.head_dim * element_size
        big = [r for r in op.block_runs if whole and r.num_blocks * run_bytes >= direct_bytes]
        direct += [(op, r) for r in big]
        rest = tuple(r for r in op.block_runs if r not in big)
        if rest:
            packed.append(op if not big else replace(op, block_runs=rest))
    return direct, packed


def run_messages(direct: Sequence[tuple[TransferOp, BlockRun]], layout: KVLayout, kv_tensors: Sequence[torch.Tensor],
                  side: str, staging) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(message, pool region) per direct run, layer and K/V in order: the message is the region
    itself where this side holds every head (region None: nothing to copy; a pool that is not
    contiguous is staged too, never received into a temporary), else a slice of the
    staging buffer `staging(numel)` returns, to be copied from (send) or into (receive) the region."""
    regions = []
    for op, run in direct:
        layer0, block, head0 = ((op.src_layer_start, run.src_block, op.src_head_start) if side == "src"
                                else (op.dst_layer_start, run.dst_block, op.dst_head_start))
        for i in range(op.num_layers):
            for region in kv_tensors[layer0 + i][:, block:block + run.num_blocks, head0:head0 + op.num_heads]:
                regions.append((region, op.num_heads == layout.num_local_heads and region.is_contiguous()))
    buf = staging(sum(r.numel() for r, whole in regions if not whole))
    messages, offset = [], 0
    for region, whole in regions:
        if whole:
            messages.append((region.view(-1).view(torch.uint8), None))
            continue
        piece = buf[offset:offset + region.numel()].view(region.shape)
        messages.append((piece.view(-1).view(torch.uint8), region))
        offset += region.numel()
    return messages


def pair_chunks(ops: Sequence[TransferOp], layout: KVLayout, chunk_bytes: int, element_size: int
                ) -> list[tuple[int, int, tuple[TransferOp, ...]]]:
    """A pair's ops cut at layer boundaries into consecutive pieces of at least `chunk_bytes`
    (the last may be smaller): (offset, numel, ops) each, offsets into the `pack_ops(ops, ...)`
    buffer, whose layout is op after op, layer after layer. `chunk_bytes <= 0`: one piece."""
    total = packed_numel(ops, layout)
    if chunk_bytes <= 0 or total * element_size <= chunk_bytes:
        return [(0, total, tuple(ops))] if ops else []
    target = -(-chunk_bytes // element_size)
    chunks: list[tuple[int, int, tuple[TransferOp, ...]]] = []
    current: list[TransferOp] = []
    offset = numel = 0
    for op in ops:
        per_layer = op_numel(op, layout) // op.num_layers
        first = 0
        while first < op.num_layers:
            take = min(op.num_layers - first, max(1, -(-(target - numel) // per_layer)))
            current.append(op if take == op.num_layers else layer_slice(op, first, first + take))
            numel += take * per_layer
            first += take
            if numel >= target:
                chunks.append((offset, numel, tuple(current)))
                offset, numel, current = offset + numel, 0, []
    if current:
        chunks.append((offset, numel, tuple(current)))
    return chunks


def layer_groups(ops: Sequence[TransferOp], by_layer: bool) -> list[tuple[int, tuple[TransferOp, ...]]]:
    """A pair's ops in message order, as (source local layer, ops) groups: the source may send a
    group once it has written that layer. One group of every op (its layer: the last one they
    read), or, `by_layer`, one group per source local layer in ascending order, each op cut to it."""
    if not ops:
        return []
    ends = [op.src_layer_start + op.num_layers for op in ops]
    if not by_layer:
        return [(max(ends) - 1, tuple(ops))]
    groups = []
    for layer in range(min(op.src_layer_start for op in ops), max(ends)):
        cut = tuple(layer_slice(op, layer - op.src_layer_start, layer - op.src_layer_start + 1)
                    for op, end in zip(ops, ends, strict=True) if op.src_layer_start <= layer < end)
        if cut:
            groups.append((layer, cut))
    return groups
