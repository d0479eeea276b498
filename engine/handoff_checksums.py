"""Block checksums of a handoff: per block, `sum over units u of m_u * c(u, b)` (mod a prime)
with c the Fletcher-like (s1, s2) of one (layer, kv head) slab of the block, so the value is
the same on any TP/PP layout (see engine/handoff.py). Every rank computes its share
(`partial_block_checksums`); the group sums them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import torch

from splitserve.engine.transfer.layout import KVLayout

PRIME = (1 << 31) - 1


def _words(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF


def _checksum_kernel_fits(kv_tensors: Sequence[torch.Tensor]) -> bool:
    """The in-place kernel (kernels/kv_checksum.py) computes the same sums on CUDA for
    16-bit caches with a power-of-two block size (a pool's layers share shape and strides);
    elsewhere the torch form runs."""
    if not kv_tensors or not kv_tensors[0].is_cuda or kv_tensors[0].element_size() != 2:
        return False
    from splitserve import kernels

    block_size = kv_tensors[0].shape[3]
    return kernels.triton_available() and block_size & (block_size - 1) == 0


def partial_block_checksums(
    kv_tensors: Sequence[torch.Tensor], layout: KVLayout, rank: int, block_ids: Sequence[int],
    layers: Sequence[int] | None = None,
) -> torch.Tensor:
    """This rank's share of the block checksums: int64 [len(block_ids), 2] (s1, s2), each < PRIME.

    Only the primary holder of a replicated head counts it, so summing the
    partials of all ranks gives every unit exactly once. `layers` (local indices) limits it to
    those layers; the shares of disjoint layer sets add up (mod PRIME) to the whole.
    """
    tp_rank, pp_rank = layout.tp_rank(rank), layout.pp_rank(rank)
    h0, h1 = layout.heads_of(tp_rank)
    heads = [h for h in range(h0, h1) if layout.is_primary(tp_rank, h)]
    device = kv_tensors[0].device if kv_tensors else torch.device("cpu")
    total = torch.zeros(len(block_ids), 2, dtype=torch.int64, device=device)
    if not heads or not block_ids or not kv_tensors:  # (a simulated engine holds no KV)
        return total
    idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=device)
    local = torch.as_tensor([h - h0 for h in heads], dtype=torch.long, device=device)
    layer_start = layout.layer_ranges[pp_rank][0]
    if _checksum_kernel_fits(kv_tensors) and layers is None:  # one launch for every layer, in place
        from splitserve import kernels

        mult = _multipliers(layout, layer_start, len(kv_tensors), tuple(heads), device)
        return kernels.kv_block_checksums(kv_tensors, idx, local, mult)
    runs = _runs(block_ids)
    where = _Units(idx, local, runs if len(runs) * _MIN_RUN <= len(block_ids) else None,
                   all_heads=len(heads) == h1 - h0 and kv_tensors[0].shape[2] == len(heads))  # fmt: skip
    todo = list(range(len(kv_tensors)) if layers is None else layers)
    mult_all = _multipliers(layout, layer_start, len(kv_tensors), tuple(heads), device)
    # layers in groups whose row/column sums stay in cache: one finishing pass a group, not a layer
    # (a 1k-token request's 16 layers paid ~0.1-0.2 ms of torch calls each)
    group = max(1, _GROUP_UNITS // (2 * len(block_ids) * len(heads)))
    for g in range(0, len(todo), group):
        chunk = todo[g:g + group]
        s1, s2 = _layer_sums([kv_tensors[i] for i in chunk], where)  # [layers, n, h] each, < PRIME
        mult = mult_all[torch.as_tensor(chunk, dtype=torch.long, device=device)].unsqueeze(1)  # [layers, 1, h]
        total[:, 0] += (s1 * mult % PRIME).sum((0, 2))
        total[:, 1] += (s2 * mult % PRIME).sum((0, 2))
        total %= PRIME
    return total


_GROUP_UNITS = 1 << 12
"""Half-units (block, head, K or V) per group of layers summed together (`_layer_sums`; a layer
with more is its own group): their int32 row and column sums (80 words each, 1.3 MB here) stay
in cache for the finishing pass. Against one layer at a time (`.scratch`-style A/B on this 2-core
machine, 1B KV shape, one thread): 256 tokens 4.6 -> 2.2 ms, 1k one run 8.3 -> 6.8 ms; groups
of 2^15-2^16 made 8k requests 15-50% slower (their sums spilled out of cache)."""


_MIN_RUN = 8
"""Blocks per run (on average) from which a request's blocks are read run by run where they lie
rather than gathered: a run costs a few torch calls (~10 µs), a gather ~2 µs a 16 KB block."""


class _Units(NamedTuple):
    """Where one rank's units of a request lie in every layer tensor: the block ids (`idx`), the
    local heads counted (`local`), the block ids' runs [(first, count)] when they are few enough
    to read in place (None: gather), and whether `local` is every head of the tensor."""

    idx: torch.Tensor
    local: torch.Tensor
    runs: list[tuple[int, int]] | None
    all_heads: bool


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """[(first id, count)] of the maximal runs of consecutive ids, in order."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def _layer_sums(tensors: Sequence[torch.Tensor], where: _Units):
    """(s1, s2) of every (block, head) unit of layer tensors [2, NB, H, bs, d]: int64 [layers, n, h] each.

    A unit's words are its K slab then its V slab (M words each), weighted 1..2M. Rather than
    gathering them into that order, each half is reduced where it lies (`_half_sums`, every
    half of every layer in one call) and the halves combine as s2 = K·i + V·i + M·ΣV; the mod
    comes once at the end — the same values as reducing the unit's words in order, several
    times faster than int64 elementwise passes.
    """
    idx, local = where.idx, where.local
    n, h = idx.numel(), local.numel()
    t0 = tensors[0]
    m = t0[0, 0, 0].numel() * t0.element_size() // 2  # words per half-unit
    if 65535 * m * (m + 1) // 2 * 2 >= 1 << 53:  # float64 would round: reduce in int64
        sums = [_int64_unit_sums(t, idx, local) for t in tensors]
        return torch.stack([a for a, _ in sums]), torch.stack([b for _, b in sums])
    pieces = (p for t in tensors for half in t for p in _pieces(half, where, m))  # layer by layer, K then V
    stats = _half_sums(pieces, len(tensors) * 2 * n * h, m, t0.device).view(len(tensors), 2, n, h, 2)  # (Σw, Σ i·w)
    k, v = stats[:, 0], stats[:, 1]
    s1 = k[..., 0] + v[..., 0]
    s2 = k[..., 1] + v[..., 1] + m * v[..., 0]
    return s1 % PRIME, s2 % PRIME


def _int64_unit_sums(t: torch.Tensor, idx: torch.Tensor, local: torch.Tensor):
    """`_layer_sums` of one layer for half-units too large for exact float64 sums: int64 [n, h] each."""
    n, h = idx.numel(), local.numel()
    x = t.index_select(1, idx).index_select(2, local)
    words = _words(x.permute(1, 2, 0, 3, 4)).reshape(n, h, -1)
    weights = torch.arange(1, words.shape[-1] + 1, dtype=torch.int64, device=t.device)
    return words.sum(-1) % PRIME, ((words * weights) % PRIME).sum(-1) % PRIME


def _pieces(half: torch.Tensor, where: _Units, m: int) -> Iterator[torch.Tensor]:
    """One half [NB, H, bs, d] of a layer's units as uint16 word pieces [units, m], in order: the
    runs of blocks as they lie (all the tensor's heads counted), else gathered a slice at a time
    as the consumer asks for it (the gathered copy is then read back from cache, not memory)."""
    if where.runs is not None and where.all_heads:
        for first, count in where.runs:
            yield half.narrow(0, first, count).view(torch.uint16).reshape(-1, m)
        return
    step = max(1, _SLICE_WORDS // (where.local.numel() * m))
    for s in range(0, where.idx.numel(), step):
        y = half.index_select(0, where.idx[s:s + step])
        if not where.all_heads:
            y = y.index_select(1, where.local)
        yield y.view(torch.uint16).reshape(-1, m)


_ROW = 64
"""Words per row of the row/column form (`_half_sums`)."""

_UNITS_PER_SLICE = 128
"""Units per slice of the float64 form."""

_SLICE_WORDS = 1 << 20
"""Words per slice of the row/column form: its widened copy (4 MB) is reused slice after slice."""

CPU_INTEGER_FORM = True
"""Sum CPU words in int32 (False: in float32, the CUDA form; both exact and equal). A knob for
the A/B in benchmarks/checksums.py."""


def _half_sums(pieces: Iterable[torch.Tensor], units: int, m: int, device: torch.device) -> torch.Tensor:
    """int64 [units, 2]: (Σ w_i, Σ i·w_i), i = 1..m, of the `units` units of uint16 word pieces [u, m]
    (taken one at a time: a gathered piece is summed before the next is gathered).

    The words of a unit as rows of 64 (i = 64a + b + 1): row sums R_a and column sums C_b, then
    Σw = ΣR, Σ i·w = 64·Σ a·R_a + Σ (b+1)·C_b over the few R and C (exact float64 GEMVs). R and C are
    reduced from a widened copy of each slice of units (torch's sums do not read uint16 without
    a widening copy of their own, one per sum: widening once feeds both), exact because every
    partial sum is an integer below 2^24 (R ≤ 64·65535, C ≤ 256·65535). On CPU in int32, ~20%
    faster than float32 on one core of this machine (benchmarks/checksums.py); on CUDA in
    float32. Other shapes (m not a multiple of 64, or above 16384): a float64 GEMV, exact below 2^53.
    """
    if m % _ROW or m // _ROW > 256:
        basis = torch.stack([torch.ones(m, dtype=torch.float64, device=device),
                             torch.arange(1, m + 1, dtype=torch.float64, device=device)], dim=1)  # fmt: skip
        return torch.cat([p[s:s + _UNITS_PER_SLICE].to(torch.float64) @ basis
                          for p in pieces for s in range(0, p.shape[0], _UNITS_PER_SLICE)]).to(torch.int64)  # fmt: skip
    dtype = torch.int32 if device.type == "cpu" and CPU_INTEGER_FORM else torch.float32
    step = max(1, _SLICE_WORDS // m)
    wide = torch.empty(min(step, units), m, dtype=dtype, device=device)
    rows = torch.empty(units, m // _ROW, dtype=dtype, device=device)
    cols = torch.empty(units, _ROW, dtype=dtype, device=device)
    done = 0
    for p in pieces:
        for s in range(0, p.shape[0], step):
            x = wide[: min(step, p.shape[0] - s)]
            x.copy_(p[s:s + step])
            k = x.shape[0]
            x = x.view(k, m // _ROW, _ROW)
            torch.sum(x, -1, out=rows[done:done + k])
            torch.sum(x, 1, out=cols[done:done + k])
            done += k
    # the weighted sums as float64 GEMVs, exact: R_a·64a < 2^36 over ≤ 256 rows, C_b·(b+1) < 2^30
    # over 64 columns, so every sum stays below 2^45 (float64 is exact to 2^53); the int64
    # broadcast products they replace took twice as long on CPU (~0.3 ms an 8k-token half-layer)
    r, c = rows.to(torch.float64), cols.to(torch.float64)
    a = torch.arange(0, m, _ROW, dtype=torch.float64, device=device)  # 64·a
    b = torch.arange(1, _ROW + 1, dtype=torch.float64, device=device)
    return torch.stack([r.sum(-1), r @ a + c @ b], dim=1).to(torch.int64)


def _unit_multipliers(layout: KVLayout, layer: int, heads: Sequence[int]) -> list[int]:
    """m_u of the units (layer, h) for h in `heads` (global head indices)."""
    return [layer * layout.num_kv_heads + h + 1 for h in heads]


_MULTIPLIERS: dict[tuple, torch.Tensor] = {}


def _multipliers(layout: KVLayout, layer_start: int, num_layers: int, heads: tuple[int, ...], device) -> torch.Tensor:
    """int64 [layers, heads] multipliers on `device`, cached: a rank's units never change, so
    a handoff does not pay a host-to-device copy for them."""
    key = (layout.num_kv_heads, layer_start, num_layers, heads, str(device))
    if key not in _MULTIPLIERS:
        rows = [_unit_multipliers(layout, layer_start + i, heads) for i in range(num_layers)]
        _MULTIPLIERS[key] = torch.tensor(rows, dtype=torch.int64).to(device)
    return _MULTIPLIERS[key]


def pack_checksums(sums: torch.Tensor) -> tuple[int, ...]:
    """[n, 2] (mod PRIME) -> one uint64 per block."""
    s = (sums % PRIME).tolist()
    return tuple((a << 32) | b for a, b in s)
