"""Which source rank / layers / kv heads / blocks go to which destination rank, for any two layouts.

A `TransferOp` moves one rectangle of KV from one source rank to one destination rank::

    for each layer in [layer_start, layer_start + num_layers)          (same global layers both sides)
      for K and V
        for each block pair (s, d) in block_runs
          src kv[src_layer][kv, s, src_head_start : src_head_start + num_heads]
            ──▶ dst kv[dst_layer][kv, d, dst_head_start : dst_head_start + num_heads]

Ops are grouped so that a plan stays small: one op per (src rank, dst rank, overlap of their
PP layer ranges, run of heads contiguous on both sides), and the block list is kept as runs
that are contiguous on both sides. E.g. src tp=2,pp=1 → dst tp=1,pp=2 with 8 kv heads::

    dst rank 0 (layers 0..L/2) ◀── src rank 0 heads 0-3 → dst heads 0-3
                               ◀── src rank 1 heads 0-3 → dst heads 4-7
    dst rank 1 (layers L/2..L) ◀── the same two ops for its layers

Replicated heads (num_kv_heads < tp on the source): each destination rank that needs a head
reads it once, from one replica, chosen greedily by least bytes already assigned to it, so the
load spreads over the replicas deterministically (both sides can rebuild the same plan).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from splitserve.engine.transfer.layout import KVLayout


@dataclass(frozen=True)
class BlockRun:
    """`num_blocks` consecutive blocks: source `src_block + i` goes to destination `dst_block + i`."""

    src_block: int
    dst_block: int
    num_blocks: int

    def __post_init__(self) -> None:
        if self.src_block < 0 or self.dst_block < 0 or self.num_blocks < 1:
            raise ValueError(f"bad block run {self!r}: ids must be >= 0 and num_blocks >= 1")


@dataclass(frozen=True)
class TransferOp:
    """One (src rank → dst rank) rectangle: layers × {K, V} × block runs × kv-head range."""

    src_rank: int
    dst_rank: int
    layer_start: int
    """First global layer."""
    num_layers: int
    src_layer_start: int
    """Local index of `layer_start` on the source rank."""
    dst_layer_start: int
    """Local index of `layer_start` on the destination rank."""
    src_head_start: int
    """First kv head, local index on the source rank."""
    dst_head_start: int
    """First kv head, local index on the destination rank."""
    num_heads: int
    block_runs: tuple[BlockRun, ...]

    def __post_init__(self) -> None:
        for name in ("src_rank", "dst_rank", "layer_start", "src_layer_start", "dst_layer_start",
                     "src_head_start", "dst_head_start"):
            if getattr(self, name) < 0:
                raise ValueError(f"TransferOp.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.num_layers < 1 or self.num_heads < 1 or not self.block_runs:
            raise ValueError(
                f"TransferOp needs num_layers >= 1, num_heads >= 1 and block runs, got "
                f"num_layers={self.num_layers!r} num_heads={self.num_heads!r} block_runs={self.block_runs!r}"
            )

    @property
    def num_blocks(self) -> int:
        return sum(run.num_blocks for run in self.block_runs)

    def src_blocks(self) -> list[int]:
        """Source block ids in transfer order."""
        return [run.src_block + i for run in self.block_runs for i in range(run.num_blocks)]

    def dst_blocks(self) -> list[int]:
        """Destination block ids in transfer order."""
        return [run.dst_block + i for run in self.block_runs for i in range(run.num_blocks)]


def layer_slice(op: TransferOp, start: int, end: int) -> TransferOp:
    """`op` cut down to its layers [start, end) (relative to `op.layer_start`)."""
    if not 0 <= start < end <= op.num_layers:
        raise ValueError(f"layer slice [{start}, {end}) out of range for an op of {op.num_layers} layers")
    return replace(op, layer_start=op.layer_start + start, num_layers=end - start,
                   src_layer_start=op.src_layer_start + start, dst_layer_start=op.dst_layer_start + start)


@dataclass(frozen=True)
class TransferPlan:
    """Everything one request's KV handoff moves, for all destination ranks; built by `build_plan`."""

    src: KVLayout
    dst: KVLayout
    first_block: int
    """First transferred block index of the request (blocks before it are cached on the destination)."""
    num_blocks: int
    """Blocks of the request on the source; blocks [first_block, num_blocks) are transferred."""
    ops: tuple[TransferOp, ...]
    _bytes_by_pair: dict[tuple[int, int], int] = field(init=False, repr=False, compare=False)
    _ops_by_pair: dict[tuple[int, int], tuple[TransferOp, ...]] = field(init=False, repr=False, compare=False)
    _sources_by_dst: dict[int, tuple[int, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.first_block <= self.num_blocks:
            raise ValueError(f"first_block {self.first_block!r} out of range [0, {self.num_blocks}]")
        pairs: dict[tuple[int, int], int] = {}
        ops_by_pair: dict[tuple[int, int], list[TransferOp]] = {}
        for op in self.ops:
            if op.src_rank >= self.src.world_size or op.dst_rank >= self.dst.world_size:
                raise ValueError(f"op {op!r} names a rank outside src world {self.src.world_size} / "
                                 f"dst world {self.dst.world_size}")
            key = (op.src_rank, op.dst_rank)
            pairs[key] = pairs.get(key, 0) + self.op_bytes(op)
            ops_by_pair.setdefault(key, []).append(op)
        object.__setattr__(self, "_bytes_by_pair", pairs)
        # looked up per pull (a GPU pull's host time counts: benchmarks/RESULTS.md, 2026-12-02 session 6)
        object.__setattr__(self, "_ops_by_pair", {key: tuple(ops) for key, ops in ops_by_pair.items()})
        sources: dict[int, list[int]] = {}
        for src, dst in sorted(ops_by_pair):
            sources.setdefault(dst, []).append(src)
        object.__setattr__(self, "_sources_by_dst", {dst: tuple(srcs) for dst, srcs in sources.items()})

    def op_bytes(self, op: TransferOp) -> int:
        """Bytes `op` moves (layers × K,V × blocks × heads)."""
        return op.num_layers * 2 * op.num_blocks * op.num_heads * self.src.head_block_bytes

    @property
    def bytes_total(self) -> int:
        return sum(self._bytes_by_pair.values())

    def bytes_by_pair(self) -> dict[tuple[int, int], int]:
        """Bytes per (src_rank, dst_rank) pair that exchanges anything."""
        return dict(self._bytes_by_pair)

    def ops_for_dst(self, dst_rank: int) -> tuple[TransferOp, ...]:
        return tuple(op for op in self.ops if op.dst_rank == dst_rank)

    def ops_for_src(self, src_rank: int) -> tuple[TransferOp, ...]:
        return tuple(op for op in self.ops if op.src_rank == src_rank)

    def ops_for_pair(self, src_rank: int, dst_rank: int) -> tuple[TransferOp, ...]:
        return self._ops_by_pair.get((src_rank, dst_rank), ())

    def sources_for(self, dst_rank: int) -> tuple[int, ...]:
        """Source ranks `dst_rank` reads from, ascending (worked out once per plan: looked up per pull)."""
        return self._sources_by_dst.get(dst_rank, ())

    def pair_bytes(self, src_rank: int, dst_rank: int) -> int:
        """Bytes the ops of one (source rank, destination rank) pair move."""
        return self._bytes_by_pair.get((src_rank, dst_rank), 0)

    def summary(self) -> str:
        """Human-readable multi-line description for logs."""
        lines = [
            f"TransferPlan blocks [{self.first_block}, {self.num_blocks}) "
            f"{len(self.ops)} ops {self.bytes_total} bytes",
            f"  src {self.src.describe()}",
            f"  dst {self.dst.describe()}",
        ]
        for (s, d), nbytes in sorted(self._bytes_by_pair.items()):
            lines.append(f"  src rank {s} -> dst rank {d}: {len(self.ops_for_pair(s, d))} ops {nbytes} bytes")
        return "\n".join(lines)


def check_compatible(src: KVLayout, dst: KVLayout) -> None:
    """Raise ValueError naming every model-level field the two layouts disagree on."""
    diffs = [
        f"{name}: src={getattr(src, name)!r} dst={getattr(dst, name)!r}"
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype")
        if getattr(src, name) != getattr(dst, name)
    ]
    if diffs:
        raise ValueError("source and destination KV layouts describe different models: " + "; ".join(diffs))
    if src.block_size != dst.block_size:
        raise ValueError(
            f"block_size differs: src={src.block_size} dst={dst.block_size}; re-blocking KV during a "
            "handoff is not supported yet, run prefill and decode with the same block size"
        )


def _check_block_ids(
    layout: KVLayout, side: str, block_ids: Mapping[int, Sequence[int]], min_len: int | None
) -> int:
    ranks = sorted(block_ids)
    if ranks != list(range(layout.world_size)):
        raise ValueError(
            f"{side}_block_ids has ranks {ranks}, expected exactly 0..{layout.world_size - 1} "
            f"(tp={layout.tp}, pp={layout.pp})"
        )
    lengths = {rank: len(ids) for rank, ids in block_ids.items()}
    for rank, ids in block_ids.items():
        is_plain = set(map(type, ids)) <= {int} and (not ids or min(ids) >= 0)  # at C speed, the usual case
        if not is_plain and any(not isinstance(b, numbers.Integral) or isinstance(b, bool) or b < 0 for b in ids):
            raise ValueError(f"{side}_block_ids[{rank}] must be non-negative ints, got {list(ids)!r}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"{side}_block_ids[{rank}] repeats a block id: {list(ids)!r}")
    if min_len is None:
        if len(set(lengths.values())) != 1:
            raise ValueError(f"{side}_block_ids lengths differ across ranks: {lengths}")
        return next(iter(lengths.values()))
    short = {rank: n for rank, n in lengths.items() if n < min_len}
    if short:
        raise ValueError(f"{side}_block_ids too short for the request's {min_len} blocks: lengths {short}")
    return min_len


def _block_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> tuple[BlockRun, ...]:
    runs: list[BlockRun] = []
    start = 0
    for i in range(1, len(src_ids) + 1):
        if i == len(src_ids) or src_ids[i] != src_ids[i - 1] + 1 or dst_ids[i] != dst_ids[i - 1] + 1:
            runs.append(BlockRun(src_ids[start], dst_ids[start], i - start))
            start = i
    return tuple(runs)


def build_plan(
    src: KVLayout,
    dst: KVLayout,
    src_block_ids: Mapping[int, Sequence[int]],
    dst_block_ids: Mapping[int, Sequence[int]],
    first_block: int = 0,
) -> TransferPlan:
    """Plan the handoff of one request's KV from layout `src` to layout `dst`.

    `src_block_ids[rank]` is the request's block table on source global rank `rank` (all ranks:
    same length); `dst_block_ids[rank]` is the destination's, at least as long (extra trailing
    blocks, e.g. room for decode, are not touched). Blocks `[first_block, len)` are transferred:
    the destination already holds the first `first_block` in its prefix cache. Deterministic.
    """
    check_compatible(src, dst)
    num_blocks = _check_block_ids(src, "src", src_block_ids, None)
    _check_block_ids(dst, "dst", dst_block_ids, num_blocks)
    src_block_ids = {rank: [int(b) for b in ids] for rank, ids in src_block_ids.items()}
    dst_block_ids = {rank: [int(b) for b in ids] for rank, ids in dst_block_ids.items()}
    if not isinstance(first_block, numbers.Integral) or not 0 <= first_block <= num_blocks:
        raise ValueError(f"first_block {first_block!r} out of range [0, {num_blocks}]")
    if first_block == num_blocks:
        return TransferPlan(src, dst, int(first_block), num_blocks, ())

    ops: list[TransferOp] = []
    load = [0] * src.world_size  # (layer, block) units read so far per source rank, to pick replicas
    for dst_rank in range(dst.world_size):
        d_tp, d_pp = dst.tp_rank(dst_rank), dst.pp_rank(dst_rank)
        d_start, d_end = dst.layer_ranges[d_pp]
        d_h0, d_h1 = dst.heads_of(d_tp)
        for s_pp, (s_start, s_end) in enumerate(src.layer_ranges):
            lo, hi = max(d_start, s_start), min(d_end, s_end)
            if lo >= hi:
                continue
            # (src_rank, src local head, dst local head) per head, in dst order.
            triples: list[tuple[int, int, int]] = []
            for head in range(d_h0, d_h1):
                holders = src.holders_of(head)
                s_tp = min(holders, key=lambda r: (load[src.rank(r, s_pp)], r))
                src_rank = src.rank(s_tp, s_pp)
                load[src_rank] += (hi - lo) * (num_blocks - first_block)
                triples.append((src_rank, head - src.heads_of(s_tp)[0], head - d_h0))
            groups: list[list[tuple[int, int, int]]] = []
            for t in triples:
                prev = groups[-1][-1] if groups else None
                if prev and prev[0] == t[0] and prev[1] + 1 == t[1] and prev[2] + 1 == t[2]:
                    groups[-1].append(t)
                else:
                    groups.append([t])
            for group in groups:
                src_rank = group[0][0]
                runs = _block_runs(src_block_ids[src_rank][first_block:num_blocks],
                                   dst_block_ids[dst_rank][first_block:num_blocks])
                ops.append(TransferOp(
                    src_rank=src_rank, dst_rank=dst_rank, layer_start=lo, num_layers=hi - lo,
                    src_layer_start=lo - s_start, dst_layer_start=lo - d_start,
                    src_head_start=group[0][1], dst_head_start=group[0][2], num_heads=len(group),
                    block_runs=runs,
                ))
    return TransferPlan(src, dst, int(first_block), num_blocks, tuple(ops))
