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
    kv_tensors: Sequence[torch.Tensor], layout: KVLayout, rank: int, block_ids: Sequence[int]
) -> torch.Tensor:
    """This rank's share of the block checksums: int64 [len(block_ids), 2] (s1, s2), each < PRIME.

    Only the primary holder of a replicated head counts it, so summing the
    partials of all ranks gives every unit exactly once.
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
    if _checksum_kernel_fits(kv_tensors):  # one launch for every layer, reading the cache where it is
        from splitserve import kernels

        mult = _multipliers(layout, layer_start, len(kv_tensors), tuple(heads), device)
        return kernels.kv_block_checksums(kv_tensors, idx, local, mult)
    for i, t in enumerate(kv_tensors):
        x = t.index_select(1, idx).index_select(2, local)  # [2, n, h, bs, d]
        words = _words(x.permute(1, 2, 0, 3, 4)).reshape(len(block_ids), len(heads), -1)  # [n, h, W]
        weights = torch.arange(1, words.shape[-1] + 1, dtype=torch.int64, device=device)
        s1 = words.sum(-1) % PRIME  # [n, h]
        s2 = ((words * weights) % PRIME).sum(-1) % PRIME
        mult = torch.as_tensor(_unit_multipliers(layout, layer_start + i, heads), dtype=torch.int64, device=device)
        total[:, 0] += (s1 * mult % PRIME).sum(-1)
        total[:, 1] += (s2 * mult % PRIME).sum(-1)
        total %= PRIME
    return total


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
