"""Source-packed reshards: the source rank gathers the head slices a destination layout needs
into contiguous memory, so the destination reads a few large regions instead of one small
strided region per (layer, K|V, block).

Why on the source. A reshard to more TP ranks (tp 1 → 2: each destination rank wants half of
every source block's heads) is strided on the source: at 8k tokens ~16k NIXL requests of 8 KiB,
which UCX serves at ~15% of memcpy on one host; reading whole blocks and cutting the heads on
the destination (`nixl_staging.py`) reads twice the bytes and copies them twice (~20%). Packed
on the source, the read is as contiguous as a same-layout handoff, and the pack — one strided
local copy — runs on the source's core, layer by layer, while the destination reads the layers
already packed (or under the prefill's compute, when the layers are packed as they are written).

Packed memory lives in an arena the transport registers before it publishes its metadata (NIXL
only lets a peer read memory the published agent metadata covers). Per request and group::

    group g = (local head start, heads) of the source rank, one per distinct head slice a
              destination rank takes from it (`pack_groups`)
    segment g: [local layer, K|V, request block (in the rank's block-table order), heads, bs, hd]

`PackedSource` tells the destination where each segment starts; an op whose head slice is not
a group, or whose blocks are not in the packed table, is read from the pool as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from splitserve.engine.transfer.layout import KVLayout
from splitserve.engine.transfer.plan import TransferOp, build_plan
from splitserve.engine.transfer.regions import Regions, coalesce, layer_kv_grid

ALIGN = 256
"""Segment alignment in the arena (bytes)."""


def pack_groups(src: KVLayout, dst: KVLayout, src_rank: int) -> list[tuple[int, int]]:
    """(local head start, heads) slices of `src_rank` that some destination rank reads and that
    are strided on the source (fewer than all its local heads); [] when nothing needs packing.
    Found by planning a one-block request, so replica choices match `build_plan`'s."""
    one = build_plan(src, dst, {r: [0] for r in range(src.world_size)}, {r: [0] for r in range(dst.world_size)})
    groups = {(op.src_head_start, op.num_heads) for op in one.ops
              if op.src_rank == src_rank and op.num_heads < src.num_local_heads}
    return sorted(groups)


@dataclass(frozen=True)
class PackedGroup:
    head_start: int
    num_heads: int
    addr: int
    """Address of the group's segment (in the source's registered arena)."""


@dataclass(frozen=True)
class PackedSource:
    """Where one source rank packed one request's head slices (travels in its endpoint bytes)."""

    block_ids: tuple[int, ...]
    """The source rank's block table of the request, the packed block order."""
    num_layers: int
    """Local layers packed (all of the rank's)."""
    groups: tuple[PackedGroup, ...]
    _pos: dict = field(default_factory=dict, compare=False, repr=False)

    def to_json(self) -> dict:
        return {"block_ids": list(self.block_ids), "num_layers": self.num_layers,
                "groups": [[g.head_start, g.num_heads, g.addr] for g in self.groups]}

    @staticmethod
    def from_json(data: dict) -> PackedSource:
        return PackedSource(tuple(int(b) for b in data["block_ids"]), int(data["num_layers"]),
                            tuple(PackedGroup(int(h), int(n), int(a)) for h, n, a in data["groups"]))

    def group(self, head_start: int, num_heads: int) -> PackedGroup | None:
        for g in self.groups:
            if g.head_start == head_start and g.num_heads == num_heads:
                return g
        return None

    def positions(self, blocks: np.ndarray) -> np.ndarray:
        """Packed index of each source block id (-1: not packed)."""
        if "table" not in self._pos:
            ids = np.asarray(self.block_ids, dtype=np.int64)
            table = np.full(int(ids.max()) + 1 if len(ids) else 1, -1, dtype=np.int64)
            table[ids] = np.arange(len(ids), dtype=np.int64)
            self._pos["table"] = table
        table = self._pos["table"]
        out = np.full(len(blocks), -1, dtype=np.int64)
        inside = blocks < len(table)
        out[inside] = table[blocks[inside]]
        return out


def segment_bytes(src: KVLayout, num_layers: int, num_blocks: int, num_heads: int) -> int:
    return num_layers * 2 * num_blocks * num_heads * src.head_block_bytes


def packed_regions(op: TransferOp, src: KVLayout, dst: KVLayout, dst_pool_blocks: int,
                   packed: PackedSource) -> Regions | None:
    """Regions reading `op` from the packed segments (`src_offset` is an absolute address,
    `src_layer` 0), or None when the op is not packed (other heads, layers or blocks)."""
    g = packed.group(op.src_head_start, op.num_heads)
    if g is None or op.src_layer_start + op.num_layers > packed.num_layers:
        return None
    src_blocks = np.asarray(op.src_blocks(), dtype=np.int64)
    pos = packed.positions(src_blocks)
    if (pos < 0).any():
        return None
    dst_blocks = np.asarray(op.dst_blocks(), dtype=np.int64)
    if dst_blocks.max() >= dst_pool_blocks:
        raise ValueError(f"dst block id {int(dst_blocks.max())} out of range for a pool of {dst_pool_blocks} blocks")
    unit, total = src.head_block_bytes, len(packed.block_ids)
    layer, kv, (j, db) = layer_kv_grid(op.num_layers, pos, dst_blocks)
    s_off = g.addr + (((layer + op.src_layer_start) * 2 + kv) * total + j) * op.num_heads * unit
    d_off = ((kv * dst_pool_blocks + db) * dst.num_local_heads + op.dst_head_start) * unit
    return coalesce(Regions(src_layer=np.zeros(len(layer), dtype=np.int64), src_offset=s_off,
                             dst_layer=layer + op.dst_layer_start, dst_offset=d_off,
                             num_bytes=np.full(len(layer), op.num_heads * unit, dtype=np.int64)))


class PackArena:
    """First-fit allocator over one registered byte tensor (the source's packed memory)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self._free: list[tuple[int, int]] = [(0, tensor.numel())]  # (start, size), sorted, merged

    @property
    def free_bytes(self) -> int:
        return sum(size for _, size in self._free)

    def alloc(self, nbytes: int) -> int | None:
        need = -(-nbytes // ALIGN) * ALIGN
        for i, (start, size) in enumerate(self._free):
            if size >= need:
                self._free[i:i + 1] = [(start + need, size - need)] if size > need else []
                return start
        return None

    def free(self, start: int, nbytes: int) -> None:
        size = -(-nbytes // ALIGN) * ALIGN
        spans = sorted([*self._free, (start, size)])
        merged: list[tuple[int, int]] = []
        for s, n in spans:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        self._free = merged


@dataclass
class PackJob:
    """One request's packed segments on a source rank."""

    packed: PackedSource
    spans: list[tuple[int, int]]
    """(arena offset, bytes) per group, freed on release."""
    views: list[torch.Tensor]
    """Per group, the segment as [layers, 2, blocks, heads, bs, hd] of the pool's dtype."""
    index: torch.Tensor
    """The block table on the pool's device (GPU: one gather per layer and group)."""
    runs: list[tuple[int, int, int]]
    """(packed index, source block, blocks) of consecutive source blocks (CPU: one slice copy each)."""
    layers_packed: int = 0


def start_job(arena: PackArena, src: KVLayout, groups: Sequence[tuple[int, int]], num_layers: int,
              block_ids: Sequence[int], dtype: torch.dtype) -> PackJob | None:
    """Reserve the segments of one request (None when the arena cannot hold them: the caller
    publishes no packed source and the destination reads the pool)."""
    spans: list[tuple[int, int]] = []
    for _, heads in groups:
        nbytes = segment_bytes(src, num_layers, len(block_ids), heads)
        start = arena.alloc(nbytes)
        if start is None:
            for s, n in spans:
                arena.free(s, n)
            return None
        spans.append((start, nbytes))
    base = arena.tensor.data_ptr()
    views = [arena.tensor[s: s + n].view(dtype).view(num_layers, 2, len(block_ids), heads, src.block_size,
                                                     src.head_dim)
             for (s, n), (_, heads) in zip(spans, groups, strict=True)]
    packed = PackedSource(tuple(int(b) for b in block_ids), num_layers,
                          tuple(PackedGroup(h, n, base + s) for (h, n), (s, _) in zip(groups, spans, strict=True)))
    index = torch.as_tensor(list(block_ids), dtype=torch.long, device=arena.tensor.device)
    runs: list[tuple[int, int, int]] = []
    for j, block in enumerate(packed.block_ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((j, block, 1))
    return PackJob(packed, spans, views, index, runs)


@torch.inference_mode()
def pack_layers(job: PackJob, kv_tensors: Sequence[torch.Tensor], start: int, end: int) -> None:
    """Gather local layers [start, end) of the job's groups from the pool into their segments.
    Under inference mode: a job begun inside the forward pass (the layer listener) has
    inference-mode views, which the layers packed after the step write into as well."""
    for g, view in zip(job.packed.groups, job.views, strict=True):
        heads = slice(g.head_start, g.head_start + g.num_heads)
        for layer in range(start, end):
            if kv_tensors[layer].is_cuda:
                torch.index_select(kv_tensors[layer][:, :, heads], 1, job.index, out=view[layer])
            else:  # a slice copy per run: torch's CPU index_select walks strided rows element-wise (~1-2 GB/s)
                for j, block, n in job.runs:
                    view[layer][:, j:j + n].copy_(kv_tensors[layer][:, block:block + n, heads])
    job.layers_packed = max(job.layers_packed, end)

