"""Reshard plans for the recurrent (Mamba2) state of a hybrid model's handoff.

A request's state is one slot per rank, per local mamba layer (see engine/state_pool.py)::

    conv[slot] : [conv_local, K - 1]      conv_local = [ x: H/tp · P | B: G/tp · N | C: G/tp · N ]
    ssm[slot]  : [H/tp, P, N]

TP rank r holds heads [r·H/tp, (r+1)·H/tp) and groups [r·G/tp, (r+1)·G/tp), so between two
TP sizes the conv channels of one rank are NOT one contiguous range of the full conv: the x
part follows the heads, the B and C parts follow the groups, each its own run::

    src tp=1 conv:  [ x0 x1 | B0 B1 | C0 C1 ]          dst tp=2 rank 0: [ x0 | B0 | C0 ]
                      └─┬┘    └┬┘     └┬┘                      rank 1: [ x1 | B1 | C1 ]
                        three runs per (src rank, dst rank, layer)

PP: stage s holds the mamba layers `layer_ranges[s]` (indices among the model's mamba layers).
A plan is a list of `StateOp`s; `state_regions` turns one into byte regions of the flat state
tensor list `[conv_0, ssm_0, conv_1, ssm_1, ...]` (local layers), the same `Regions` the KV
transports move. Torch-free, like layout.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from splitserve.engine.transfer.layout import DTYPE_ITEMSIZE
from splitserve.engine.transfer.regions import Regions


@dataclass(frozen=True)
class StateLayout:
    """How one engine (TP × PP group) holds the recurrent state; identical on all its ranks."""

    tp: int
    pp: int
    num_layers: int
    """Mamba layers of the whole model."""
    layer_ranges: tuple[tuple[int, int], ...]
    """Mamba-layer indices [start, end) of each PP stage (a stage may hold none)."""
    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_width: int
    """K - 1: inputs the conv state keeps."""
    conv_dtype: str
    ssm_dtype: str

    def __post_init__(self) -> None:
        if self.num_heads % self.tp or self.num_groups % self.tp:
            raise ValueError(f"heads {self.num_heads} / groups {self.num_groups} cannot be split over tp={self.tp}")
        if len(self.layer_ranges) != self.pp:
            raise ValueError(f"layer_ranges {self.layer_ranges!r} has {len(self.layer_ranges)} stages, pp={self.pp}")
        for name in ("conv_dtype", "ssm_dtype"):
            if getattr(self, name) not in DTYPE_ITEMSIZE:
                raise ValueError(f"{name} {getattr(self, name)!r} is not one of {sorted(DTYPE_ITEMSIZE)}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.tp

    @property
    def groups_per_rank(self) -> int:
        return self.num_groups // self.tp

    @property
    def conv_local(self) -> int:
        """Conv channels per rank."""
        return self.heads_per_rank * self.head_dim + 2 * self.groups_per_rank * self.state_size

    @property
    def conv_dim(self) -> int:
        return self.num_heads * self.head_dim + 2 * self.num_groups * self.state_size

    @property
    def conv_row_bytes(self) -> int:
        return self.conv_width * DTYPE_ITEMSIZE[self.conv_dtype]

    @property
    def head_bytes(self) -> int:
        return self.head_dim * self.state_size * DTYPE_ITEMSIZE[self.ssm_dtype]

    def num_local_layers(self, pp_rank: int) -> int:
        start, end = self.layer_ranges[pp_rank]
        return end - start

    def local_conv_channels(self, tp_rank: int) -> np.ndarray:
        """Global conv channel of each local channel of `tp_rank` ([x heads | B groups | C groups])."""
        p, n = self.head_dim, self.state_size
        h0, g0 = tp_rank * self.heads_per_rank, tp_rank * self.groups_per_rank
        d_in, gn = self.num_heads * p, self.num_groups * n
        x = np.arange(h0 * p, (h0 + self.heads_per_rank) * p)
        b = d_in + np.arange(g0 * n, (g0 + self.groups_per_rank) * n)
        return np.concatenate([x, b, b + gn]).astype(np.int64)

    def describe(self) -> str:
        return (f"tp={self.tp} pp={self.pp} mamba_layers={self.layer_ranges} heads={self.num_heads}x{self.head_dim} "
                f"groups={self.num_groups}x{self.state_size} conv={self.conv_width}+1 "
                f"dtypes={self.conv_dtype}/{self.ssm_dtype}")


@dataclass(frozen=True)
class StateRun:
    """`length` consecutive rows of one tensor kind: conv channels or SSM heads (local indices)."""

    kind: str
    """"conv" or "ssm"."""
    src_start: int
    dst_start: int
    length: int


@dataclass(frozen=True)
class StateOp:
    """One (src rank → dst rank) piece: the same runs for each of `num_layers` mamba layers."""

    src_rank: int
    dst_rank: int
    layer_start: int
    """First global mamba layer."""
    num_layers: int
    src_layer_start: int
    dst_layer_start: int
    runs: tuple[StateRun, ...]


def check_state_compatible(src: StateLayout, dst: StateLayout) -> None:
    fields = ("num_layers", "num_heads", "head_dim", "num_groups", "state_size", "conv_width", "conv_dtype", "ssm_dtype")
    diffs = [f"{f}: src={getattr(src, f)!r} dst={getattr(dst, f)!r}" for f in fields if getattr(src, f) != getattr(dst, f)]
    if diffs:
        raise ValueError("source and destination recurrent-state layouts differ: " + "; ".join(diffs))


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def _runs(src: StateLayout, s_tp: int, dst: StateLayout, d_tp: int) -> tuple[StateRun, ...]:
    """Conv and SSM runs from src TP rank `s_tp` to dst TP rank `d_tp` (any order of sizes)."""
    p, n = src.head_dim, src.state_size
    s_h, d_h = s_tp * src.heads_per_rank, d_tp * dst.heads_per_rank
    s_g, d_g = s_tp * src.groups_per_rank, d_tp * dst.groups_per_rank
    runs = []
    heads = _overlap((s_h, s_h + src.heads_per_rank), (d_h, d_h + dst.heads_per_rank))
    if heads:
        lo, hi = heads
        runs.append(StateRun("conv", (lo - s_h) * p, (lo - d_h) * p, (hi - lo) * p))  # x channels
    groups = _overlap((s_g, s_g + src.groups_per_rank), (d_g, d_g + dst.groups_per_rank))
    if groups:
        lo, hi = groups
        s_x, d_x = src.heads_per_rank * p, dst.heads_per_rank * p
        s_gn, d_gn = src.groups_per_rank * n, dst.groups_per_rank * n
        for part in range(2):  # B, then C
            runs.append(StateRun("conv", s_x + part * s_gn + (lo - s_g) * n, d_x + part * d_gn + (lo - d_g) * n,
                                 (hi - lo) * n))
    if heads:
        lo, hi = heads
        runs.append(StateRun("ssm", lo - s_h, lo - d_h, hi - lo))
    return tuple(runs)


def build_state_plan(src: StateLayout, dst: StateLayout) -> tuple[StateOp, ...]:
    """Every piece of state each destination rank needs, and where from. Deterministic."""
    check_state_compatible(src, dst)
    ops = []
    for dst_rank in range(dst.world_size):
        d_tp, d_pp = dst_rank % dst.tp, dst_rank // dst.tp
        for s_pp, s_range in enumerate(src.layer_ranges):
            layers = _overlap(s_range, dst.layer_ranges[d_pp])
            if not layers:
                continue
            for s_tp in range(src.tp):
                runs = _runs(src, s_tp, dst, d_tp)
                if runs:
                    ops.append(StateOp(
                        src_rank=s_pp * src.tp + s_tp, dst_rank=dst_rank, layer_start=layers[0],
                        num_layers=layers[1] - layers[0], src_layer_start=layers[0] - s_range[0],
                        dst_layer_start=layers[0] - dst.layer_ranges[d_pp][0], runs=runs,
                    ))
    return tuple(ops)


def state_regions(ops: Iterable[StateOp], src: StateLayout, dst: StateLayout, src_slot: int, dst_slot: int) -> Regions:
    """Byte regions of `ops` between the flat state tensor lists `[conv_0, ssm_0, conv_1, ...]`."""
    rows = []
    for op in ops:
        for i in range(op.num_layers):
            for run in op.runs:
                if run.kind == "conv":
                    unit, s_base, d_base, t = src.conv_row_bytes, src_slot * src.conv_local, dst_slot * dst.conv_local, 0
                else:
                    unit, s_base, d_base, t = src.head_bytes, src_slot * src.heads_per_rank, dst_slot * dst.heads_per_rank, 1
                rows.append((2 * (op.src_layer_start + i) + t, (s_base + run.src_start) * unit,
                             2 * (op.dst_layer_start + i) + t, (d_base + run.dst_start) * unit, run.length * unit))
    if not rows:
        return Regions.concat([])
    a = np.asarray(rows, dtype=np.int64)
    return Regions(a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4])


def state_bytes(ops: Iterable[StateOp], src: StateLayout) -> int:
    return sum(
        op.num_layers * run.length * (src.conv_row_bytes if run.kind == "conv" else src.head_bytes)
        for op in ops for run in op.runs
    )
