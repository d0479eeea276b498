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
"""Words per row of the float32 form (`_half_sums`)."""

_UNITS_PER_SLICE = 128


def _half_sums(words: torch.Tensor) -> torch.Tensor:
    """int64 [units, 2]: (Σ w_i, Σ i·w_i), i = 1..m, of uint16 words [units, m].

    float32 where every partial sum is an integer below 2^24, so exact in any summation order:
    the words of a unit as rows of 64 (i = 64a + b + 1), row sums R_a (≤ 64·65535) and column
    sums C_b (≤ (m/64)·65535, m ≤ 16384), then Σw = ΣR, Σ i·w = 64·Σ a·R_a + Σ (b+1)·C_b in
    int64 over the few R and C. 4-6 GB/s on one core of this machine against ~1 GB/s for a
    float64 GEMV per unit (a uint16 → float64 copy is 4 bytes written per byte read; float32
    and two sums, 2). Slices of `_UNITS_PER_SLICE` units keep the float32 copy in L2.
    Elsewhere (m not a multiple of 64, or above 16384) the float64 GEMV, exact below 2^53.
    """
    units, m = words.shape
    if m % _ROW or m // _ROW > 256:
        basis = torch.stack([torch.ones(m, dtype=torch.float64, device=words.device),
                             torch.arange(1, m + 1, dtype=torch.float64, device=words.device)], dim=1)  # fmt: skip
        return torch.cat([words[s:s + _UNITS_PER_SLICE].to(torch.float64) @ basis
                          for s in range(0, units, _UNITS_PER_SLICE)]).to(torch.int64)  # fmt: skip
    rows, cols = [], []
    for s in range(0, units, _UNITS_PER_SLICE):
        x = words[s:s + _UNITS_PER_SLICE].to(torch.float32).view(-1, m // _ROW, _ROW)
        rows.append(x.sum(-1))
        cols.append(x.sum(1))
    r = torch.cat(rows).to(torch.int64)  # [units, m/64]
    c = torch.cat(cols).to(torch.int64)  # [units, 64]
    a = torch.arange(m // _ROW, dtype=torch.int64, device=words.device)
    b = torch.arange(1, _ROW + 1, dtype=torch.int64, device=words.device)
    return torch.stack([r.sum(-1), _ROW * (r * a).sum(-1) + (c * b).sum(-1)], dim=1)


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
