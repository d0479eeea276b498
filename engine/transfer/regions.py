"""Turn plan ops into byte regions of the per-layer KV tensors, for transports that move memory.

Within one layer tensor `[2, P, H, block_size, head_dim]` (P pool blocks, H local heads), the
bytes of (kv, block b, heads [h, h + n)) start at::

    offset = ((kv * P + b) * H + h) * head_block_bytes        length = n * head_block_bytes

One region per (layer, K|V, block) is generated, then neighbours that are contiguous on *both*
sides are coalesced: with all heads on both sides a whole block run becomes one region, with a
head slice on either side each block stays its own region (a strided pattern). Arrays are numpy
so the ~100k regions of a long prompt cost milliseconds, not a Python loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from splitserve.engine.transfer.layout import KVLayout
from splitserve.engine.transfer.plan import TransferOp


@dataclass(frozen=True)
class Regions:
    """Parallel int64 arrays, one entry per region: copy `num_bytes` from
    src kv[src_layer] byte `src_offset` to dst kv[dst_layer] byte `dst_offset` (local layers)."""

    src_layer: np.ndarray
    src_offset: np.ndarray
    dst_layer: np.ndarray
    dst_offset: np.ndarray
    num_bytes: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.num_bytes)
        for name in ("src_layer", "src_offset", "dst_layer", "dst_offset"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Regions.{name} has {len(getattr(self, name))} entries, expected {n}")

    def __len__(self) -> int:
        return len(self.num_bytes)

    @property
    def bytes_total(self) -> int:
        return int(self.num_bytes.sum())

    @staticmethod
    def concat(parts: Iterable[Regions]) -> Regions:
        parts = list(parts)
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return Regions(empty, empty, empty, empty, empty)
        return Regions(*(np.concatenate([getattr(p, f) for p in parts]) for f in
                         ("src_layer", "src_offset", "dst_layer", "dst_offset", "num_bytes")))


def layer_kv_grid(num_layers: int, *per_block: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """The index grid [layer, K|V, block] flattened in that order: layer and kv per entry, and
    each per-block array of the same length repeated for every (layer, K|V)."""
    nb = len(per_block[0])
    layer = np.repeat(np.arange(num_layers, dtype=np.int64), 2 * nb)
    kv = np.tile(np.repeat(np.arange(2, dtype=np.int64), nb), num_layers)
    return layer, kv, [np.tile(a, 2 * num_layers) for a in per_block]


def op_regions(
    op: TransferOp, src: KVLayout, dst: KVLayout, src_pool_blocks: int, dst_pool_blocks: int
) -> Regions:
    """Byte regions of `op`, ordered by (layer, K|V, block), contiguous neighbours merged."""
    src_blocks = np.asarray(op.src_blocks(), dtype=np.int64)
    dst_blocks = np.asarray(op.dst_blocks(), dtype=np.int64)
    for side, blocks, pool in (("src", src_blocks, src_pool_blocks), ("dst", dst_blocks, dst_pool_blocks)):
        if blocks.max() >= pool:
            raise ValueError(f"{side} block id {int(blocks.max())} out of range for a pool of {pool} blocks")
    unit = src.head_block_bytes
    layer, kv, (sb, db) = layer_kv_grid(op.num_layers, src_blocks, dst_blocks)
    s_off = ((kv * src_pool_blocks + sb) * src.num_local_heads + op.src_head_start) * unit
    d_off = ((kv * dst_pool_blocks + db) * dst.num_local_heads + op.dst_head_start) * unit
    return coalesce(Regions(
        src_layer=layer + op.src_layer_start,
        src_offset=s_off,
        dst_layer=layer + op.dst_layer_start,
        dst_offset=d_off,
        num_bytes=np.full(len(layer), op.num_heads * unit, dtype=np.int64),
    ))


def ops_regions(
    ops: Iterable[TransferOp], src: KVLayout, dst: KVLayout, src_pool_blocks: int, dst_pool_blocks: int
) -> Regions:
    """`op_regions` of several ops, concatenated in order."""
    return Regions.concat(op_regions(op, src, dst, src_pool_blocks, dst_pool_blocks) for op in ops)


def coalesce(r: Regions) -> Regions:
    if len(r) <= 1:
        return r
    src_end = r.src_offset + r.num_bytes
    dst_end = r.dst_offset + r.num_bytes
    joins = (
        (r.src_layer[1:] == r.src_layer[:-1])
        & (r.dst_layer[1:] == r.dst_layer[:-1])
        & (r.src_offset[1:] == src_end[:-1])
        & (r.dst_offset[1:] == dst_end[:-1])
    )
    starts = np.concatenate([[0], np.nonzero(~joins)[0] + 1])
    return Regions(
        src_layer=r.src_layer[starts],
        src_offset=r.src_offset[starts],
        dst_layer=r.dst_layer[starts],
        dst_offset=r.dst_offset[starts],
        num_bytes=np.add.reduceat(r.num_bytes, starts),
    )
