"""Order-sensitive checksums of transferred KV, identical on any TP/PP layout.

The unit is one (global layer, global kv head) over the request's transferred blocks, in order::

    unit(layer, head) = checksum( kv[layer][0:2, blocks[first_block:], head] )    # [2, n, block_size, head_dim]

Every layout holds each unit whole on one rank (replicas hold copies), so the source computes
the units at pin time, on its layout, and the destination verifies them after import, on its own.

The checksum views the bytes as 16-bit words w_i (8-bit for 1-byte dtypes) and returns
`(s1 << 32) | s2` with `s1 = Σ w_i mod P`, `s2 = Σ (i+1)·w_i mod P`, P = 2^31 - 1 (Fletcher-like):
any single changed word changes s1 (|Δw| < P), and swaps change s2. Pure torch ops, so it runs
where the tensors live (CPU or CUDA) and syncs with the host once, when results are read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from splitserve.engine.transfer.kv_tensors import check_kv_tensors
from splitserve.engine.transfer.layout import KVLayout

PRIME = (1 << 31) - 1


class Unit(NamedTuple):
    """A checksum unit: one global layer's one global kv head."""

    layer: int
    kv_head: int


def _words(x: torch.Tensor) -> torch.Tensor:
    """View the last dim's bytes as unsigned words, int64: [..., head_dim * itemsize / wordsize]."""
    x = x.contiguous()
    if x.element_size() == 1:
        return x.view(torch.uint8).to(torch.int64)
    return x.view(torch.int16).to(torch.int64) & 0xFFFF


def _checksum_rows(rows: torch.Tensor) -> torch.Tensor:
    """Checksum each row of a 2-D int64 word tensor; returns int64 [num_rows] (fits uint64 as >= 0)."""
    n = rows.shape[1]
    weights = torch.arange(1, n + 1, dtype=torch.int64, device=rows.device) % PRIME
    s1 = rows.sum(dim=1) % PRIME  # < 2^16 * n: fine for n < 2^47
    s2 = ((rows * weights) % PRIME).sum(dim=1) % PRIME  # terms < 2^31, n < 2^32
    return (s1 << 32) | s2


def tensor_checksum(x: torch.Tensor) -> int:
    """Checksum of all of `x`'s bytes in row-major order."""
    return int(_checksum_rows(_words(x).reshape(1, -1))[0].item())


def unit_checksums(
    kv_tensors: Sequence[torch.Tensor],
    layout: KVLayout,
    rank: int,
    block_ids: Sequence[int],
    first_block: int = 0,
    include_replicas: bool = False,
) -> dict[Unit, int]:
    """Checksums of every unit held by `rank`, over `block_ids[first_block:]`.

    Replicated heads are reported only by their primary holder unless `include_replicas`, so
    merging the dicts of all ranks of a layout yields each unit exactly once.
    """
    check_kv_tensors(kv_tensors, layout, rank)
    if not 0 <= first_block <= len(block_ids):
        raise ValueError(f"first_block {first_block!r} out of range [0, {len(block_ids)}]")
    tp_rank, pp_rank = layout.tp_rank(rank), layout.pp_rank(rank)
    h0, h1 = layout.heads_of(tp_rank)
    heads = [h for h in range(h0, h1) if include_replicas or layout.is_primary(tp_rank, h)]
    if not heads:
        return {}
    layer_start = layout.layer_ranges[pp_rank][0]
    device = kv_tensors[0].device
    idx = torch.as_tensor(list(block_ids[first_block:]), dtype=torch.long, device=device)
    local = torch.as_tensor([h - h0 for h in heads], dtype=torch.long, device=device)
    sums = []
    for t in kv_tensors:
        x = t.index_select(1, idx).index_select(2, local)  # [2, n, heads, bs, hd]
        rows = _words(x.permute(2, 0, 1, 3, 4)).reshape(len(heads), -1)
        sums.append(_checksum_rows(rows))
    values = torch.stack(sums).tolist()  # the one host sync
    return {
        Unit(layer_start + i, head): values[i][j]
        for i in range(len(kv_tensors))
        for j, head in enumerate(heads)
    }


def verify_unit_checksums(
    kv_tensors: Sequence[torch.Tensor],
    layout: KVLayout,
    rank: int,
    block_ids: Sequence[int],
    expected: Mapping[Unit, int] | Mapping[tuple[int, int], int],
    first_block: int = 0,
) -> list[Unit]:
    """Units on `rank` (replicas included) whose data does not match `expected`, sorted.

    A unit missing from `expected` counts as a mismatch: it cannot be vouched for.
    """
    actual = unit_checksums(kv_tensors, layout, rank, block_ids, first_block, include_replicas=True)
    return sorted(unit for unit, value in actual.items() if expected.get(unit) != value)
