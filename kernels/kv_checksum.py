"""A rank's share of a handoff's block checksums, read in place from every layer of its KV pool.

    layers × kv [2, NB, Hkv, BS, D] (16-bit dtype), block_ids [n], heads [h],
    multipliers [layers, h] -> int64 [n, 2]

For block b, head g of layer l the unit is the [2, BS, D] slab kv_l[:, b, g] (K then V), read
as unsigned 16-bit words w_i in that order, with sums

    (s1, s2) = (Σ w_i mod P, Σ (i + 1)·w_i mod P),   P = 2^31 - 1

and the block's result is Σ over units of m_u · (s1, s2) mod P — what the handoff's block
checksums (engine/handoff.py) are. The torch form gathers the blocks, permutes them and widens
every word to int64 (several passes over a 268 MB prompt's KV at 8k tokens, and a handful of
launches per layer); here one launch has a program per (block, head, layer) that reads its slab
once from the cache, and one sum folds the units.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_kv, layer_offsets, next_power_of_2

__all__ = ["PRIME", "kv_block_checksums", "kv_block_checksums_reference", "kv_block_sums_reference"]

PRIME = (1 << 31) - 1


def kv_block_sums_reference(kv: torch.Tensor, block_ids: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    x = kv.index_select(1, block_ids.long()).index_select(2, heads.long())  # [2, n, h, bs, d]
    words = x.permute(1, 2, 0, 3, 4).contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    words = words.reshape(len(block_ids), len(heads), -1)
    weights = torch.arange(1, words.shape[-1] + 1, dtype=torch.int64, device=kv.device)
    s1 = words.sum(-1) % PRIME
    s2 = ((words * weights) % PRIME).sum(-1) % PRIME
    return torch.stack([s1, s2], dim=-1)


def kv_block_checksums_reference(
    kv_tensors, block_ids: torch.Tensor, heads: torch.Tensor, multipliers: torch.Tensor
) -> torch.Tensor:
    """int64 [n, 2]: Σ over layers l and heads j of multipliers[l, j] · (s1, s2)(block, head j of layer l), mod P."""
    total = torch.zeros(len(block_ids), 2, dtype=torch.int64, device=multipliers.device)
    for layer, kv in enumerate(kv_tensors):
        sums = kv_block_sums_reference(kv, block_ids, heads)  # [n, h, 2]
        total += (sums * multipliers[layer][None, :, None] % PRIME).sum(1)
        total %= PRIME
    return total


@triton.jit
def _slab_sums(kv_ptr, block, head, stride_kv, stride_blk, stride_h, stride_tok,
               PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """(s1, s2) of the [2, BS, D] slab kv[:, block, head] as 16-bit words (see the module docstring)."""
    offs_t = tl.arange(0, PAGE_SIZE)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_d < HEAD_DIM)[None, :]
    base = kv_ptr + block * stride_blk + head * stride_h + offs_t[:, None] * stride_tok + offs_d[None, :]
    s1 = tl.zeros([], tl.int64)
    s2 = tl.zeros([], tl.int64)
    # Word (t, d) of half h has index i = h·BS·D + t·D + d, so Σ (i+1)·w splits into per-row sums
    # in int32 (int64 arithmetic is several times slower on GPUs): r_t = Σ_d w (< 2^16·D) and
    # q_t = Σ_d (d+1)·w (< 2^16·D²/2: int32 up to D = 128, int64 above), then 16-odd int64 terms.
    for half in range(2):  # K then V: V's words follow K's
        w = tl.load(base + half * stride_kv, mask=mask, other=0).to(tl.int32) & 0xFFFF
        r = tl.sum(w, 1).to(tl.int64)
        if BLOCK_D <= 128:
            q = tl.sum(w * (offs_d[None, :] + 1), 1).to(tl.int64)
        else:
            q = tl.sum(w.to(tl.int64) * (offs_d[None, :] + 1).to(tl.int64), 1)
        start = (half * PAGE_SIZE + offs_t).to(tl.int64) * HEAD_DIM  # index of each row's first word
        s1 += tl.sum(r, 0)
        s2 += tl.sum(start * r + q, 0)
    return s1 % 2147483647, s2 % 2147483647


@triton.jit
def _block_checksums_kernel(kv_ptr, layer_offsets_ptr, block_ids_ptr, heads_ptr, mult_ptr, out_ptr, stride_kv,
                            stride_blk, stride_h, stride_tok, num_heads, num_layers, PAGE_SIZE: tl.constexpr,
                            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (block i, head j, layer l): its slab's sums times the unit's multiplier, mod P."""
    i = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    layer = tl.program_id(2).to(tl.int64)
    block = tl.load(block_ids_ptr + i).to(tl.int64)
    head = tl.load(heads_ptr + j).to(tl.int64)
    layer_ptr = kv_ptr + tl.load(layer_offsets_ptr + layer)
    s1, s2 = _slab_sums(layer_ptr, block, head, stride_kv, stride_blk, stride_h, stride_tok, PAGE_SIZE, HEAD_DIM,
                        BLOCK_D)
    m = tl.load(mult_ptr + layer * num_heads + j)  # < 2^31: the products stay below 2^62
    base_out = out_ptr + ((i * num_layers + layer) * num_heads + j) * 2
    tl.store(base_out, s1 * m % 2147483647)
    tl.store(base_out + 1, s2 * m % 2147483647)


def kv_block_checksums(
    kv_tensors, block_ids: torch.Tensor, heads: torch.Tensor, multipliers: torch.Tensor
) -> torch.Tensor:
    """`kv_block_checksums_reference` over every layer of a pool in one launch (+ one sum):
    what a handoff's block checksums need from one rank, without a launch and a host-to-device
    copy per layer. `kv_tensors` share one shape, strides and 16-bit dtype; `multipliers` is
    int64 [layers, heads] on their device, each < P."""
    first = kv_tensors[0]
    check_kv(first, first.shape[4])
    if first.element_size() != 2 or next_power_of_2(first.shape[3]) != first.shape[3]:
        raise ValueError(f"kv_block_checksums reads 16-bit words of power-of-two blocks, got {first.dtype}, "
                         f"block size {first.shape[3]}")
    n, h, num_layers = len(block_ids), len(heads), len(kv_tensors)
    if tuple(multipliers.shape) != (num_layers, h):
        raise ValueError(f"multipliers must be [{num_layers}, {h}], got {tuple(multipliers.shape)}")
    if n == 0 or h == 0:
        return torch.zeros(n, 2, dtype=torch.int64, device=first.device)
    out = torch.empty(n, num_layers, h, 2, dtype=torch.int64, device=first.device)
    offsets = layer_offsets(kv_tensors, first.device, align=1)  # checks that every layer matches the first
    w = first.view(torch.int16)
    _block_checksums_kernel[(n, h, num_layers)](
        w, offsets, block_ids, heads, multipliers, out, w.stride(0), w.stride(1),
        w.stride(2), w.stride(3), h, num_layers, PAGE_SIZE=first.shape[3], HEAD_DIM=first.shape[4],
        BLOCK_D=next_power_of_2(first.shape[4]), num_warps=4,
    )
    return out.sum((1, 2)) % PRIME  # terms < 2^31, far fewer than 2^32 of them: no int64 overflow
