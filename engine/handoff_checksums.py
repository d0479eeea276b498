"""Block checksums of a handoff: per block, `sum over units u of m_u * c(u, b)` (mod a prime)
with c the Fletcher-like (s1, s2) of one (layer, kv head) slab of the block, so the value is
the same on any TP/PP layout (see engine/handoff.py). Every rank computes its share
(`partial_block_checksums`); the group sums them.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    if not heads or not block_ids:
        return total
    idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=device)
    local = torch.as_tensor([h - h0 for h in heads], dtype=torch.long, device=device)
    layer_start = layout.layer_ranges[pp_rank][0]
    if _checksum_kernel_fits(kv_tensors) and layers is None:  # one launch for every layer, in place
        from splitserve import kernels

        mult = _multipliers(layout, layer_start, len(kv_tensors), tuple(heads), device)
        return kernels.kv_block_checksums(kv_tensors, idx, local, mult)
    for i in range(len(kv_tensors)) if layers is None else layers:
        s1, s2 = _unit_sums(kv_tensors[i], idx, local, block_ids)  # [n, h] each, < PRIME
        mult = torch.as_tensor(_unit_multipliers(layout, layer_start + i, heads), dtype=torch.int64, device=device)
        total[:, 0] += (s1 * mult % PRIME).sum(-1)
        total[:, 1] += (s2 * mult % PRIME).sum(-1)
        total %= PRIME
    return total


def _unit_sums(t: torch.Tensor, idx: torch.Tensor, local: torch.Tensor, block_ids: Sequence[int]):
    """(s1, s2) of every (block, head) unit of one layer tensor [2, NB, H, bs, d]: int64 [n, h] each.

    A unit's words are its K slab then its V slab (M words each), weighted 1..2M. Rather than
    gathering them into that order, each half is reduced where it lies (`_half_sums`) and the
    halves combine as s2 = K·i + V·i + M·ΣV; the mod comes once at the end — the same values as
    reducing the unit's words in order, several times faster than int64 elementwise passes.
    """
    n, h = len(block_ids), local.numel()
    is_run = n and list(block_ids) == list(range(block_ids[0], block_ids[0] + n))
    all_heads = h == t.shape[2] and torch.equal(local, torch.arange(h, device=local.device))
    m = t[0, 0, 0].numel() * t.element_size() // 2  # words per half-unit
    if 65535 * m * (m + 1) // 2 * 2 >= 1 << 53:  # float64 would round: reduce in int64
        x = t.index_select(1, idx).index_select(2, local)
        words = _words(x.permute(1, 2, 0, 3, 4)).reshape(n, h, -1)
        weights = torch.arange(1, words.shape[-1] + 1, dtype=torch.int64, device=t.device)
        return words.sum(-1) % PRIME, ((words * weights) % PRIME).sum(-1) % PRIME
    sums = []
    for half in t:  # K, then V: [NB, H, bs, d]
        y = half.narrow(0, block_ids[0], n) if is_run else half.index_select(0, idx)  # a run: no gather
        if not all_heads:
            y = y.index_select(1, local)
        sums.append(_half_sums(y.contiguous().view(torch.uint16).reshape(n * h, m)))
    k, v = sums  # [units, 2]: (Σw, Σ i·w) per half
    s1 = k[:, 0] + v[:, 0]
    s2 = k[:, 1] + v[:, 1] + m * v[:, 0]
    return (s1 % PRIME).reshape(n, h), (s2 % PRIME).reshape(n, h)


_ROW = 64
"""Words per row of the row/column forms (`_half_sums`)."""

_UNITS_PER_SLICE = 128
"""Units per slice of the float32 form: its float32 copy stays in L2."""

_SLICE_BYTES = 2 << 20
"""Bytes of words per slice of the integer form: read twice (rows, then columns) from L2."""

CPU_INTEGER_FORM = True
"""Reduce CPU words with the integer form; False takes the float32 form there too (its A/B
in benchmarks/checksums.py — both give the same sums)."""


def _half_sums(words: torch.Tensor) -> torch.Tensor:
    """int64 [units, 2]: (Σ w_i, Σ i·w_i), i = 1..m, of uint16 words [units, m].

    The words of a unit as rows of 64 (i = 64a + b + 1): row sums R_a and column sums C_b, then
    Σw = ΣR, Σ i·w = 64·Σ a·R_a + Σ (b+1)·C_b in int64 over the few R and C. On CPU
    (`_half_sums_int`) R and C are reduced from the uint16 words straight into int32 — exact
    (R ≤ 64·65535, C ≤ 256·65535) and no widened copy of the words. Elsewhere in float32, exact
    because every partial sum is an integer below 2^24 (torch's CUDA reductions need not take
    uint16). Other shapes (m not a multiple of 64, or above 16384): a float64 GEMV, exact below 2^53.
    """
    units, m = words.shape
    if m % _ROW or m // _ROW > 256:
        basis = torch.stack([torch.ones(m, dtype=torch.float64, device=words.device),
                             torch.arange(1, m + 1, dtype=torch.float64, device=words.device)], dim=1)  # fmt: skip
        return torch.cat([words[s:s + _UNITS_PER_SLICE].to(torch.float64) @ basis
                          for s in range(0, units, _UNITS_PER_SLICE)]).to(torch.int64)  # fmt: skip
    a = torch.arange(0, m, _ROW, dtype=torch.int64, device=words.device)  # 64·a
    b = torch.arange(1, _ROW + 1, dtype=torch.int64, device=words.device)
    if words.is_cpu and CPU_INTEGER_FORM:
        return _half_sums_int(words, a, b)
    rows, cols = [], []
    for s in range(0, units, _UNITS_PER_SLICE):
        x = words[s:s + _UNITS_PER_SLICE].to(torch.float32).view(-1, m // _ROW, _ROW)
        rows.append(x.sum(-1))
        cols.append(x.sum(1))
    r = torch.cat(rows).to(torch.int64)  # [units, m/64]
    c = torch.cat(cols).to(torch.int64)  # [units, 64]
    return torch.stack([r.sum(-1), (r * a).sum(-1) + (c * b).sum(-1)], dim=1)  # no int64 matmul on CUDA


def _half_sums_int(words: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The CPU form of `_half_sums`: 2-3x the float32 form on one core of this machine (uint16
    sums into int32 run at ~8 GB/s; the float32 form first writes 4 bytes per word), in slices
    of `_SLICE_BYTES` so the column pass reads the words from L2, each slice's few int64 results
    written in place (fresh multi-MB intermediates cost page faults on every call)."""
    units, m = words.shape
    out = torch.empty(units, 2, dtype=torch.int64)
    step = max(1, _SLICE_BYTES // (2 * m))
    for s in range(0, units, step):
        x = words[s:s + step].view(-1, m // _ROW, _ROW)
        r = x.sum(-1, dtype=torch.int32).to(torch.int64)  # [slice, m/64]
        c = x.sum(1, dtype=torch.int32).to(torch.int64)  # [slice, 64]
        o = out[s:s + step]
        torch.sum(r, -1, out=o[:, 0])
        torch.add(r @ a, c @ b, out=o[:, 1])
    return out


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
