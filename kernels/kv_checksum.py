"""Per-(block, kv head) checksum sums of a paged KV layer, read in place.

    kv [2, NB, Hkv, BS, D] (16-bit dtype), block_ids [n], heads [h] -> int64 [n, h, 2]

For block b and head g the unit is the [2, BS, D] slab kv[:, b, g] (K then V), read as
unsigned 16-bit words w_i in that order, and the result is

    (s1, s2) = (Σ w_i mod P, Σ (i + 1)·w_i mod P),   P = 2^31 - 1

— what the handoff's block checksums (engine/handoff.py) are built from. The torch
form gathers the blocks, permutes them and widens every word to int64 (several
passes over a 268 MB prompt's KV at 8k tokens); here one program per (block, head)
reads its slab once from the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_kv, next_power_of_2

__all__ = ["PRIME", "kv_block_sums", "kv_block_sums_reference"]

PRIME = (1 << 31) - 1


def kv_block_sums_reference(kv: torch.Tensor, block_ids: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    x = kv.index_select(1, block_ids.long()).index_select(2, heads.long())  # [2, n, h, bs, d]
    words = x.permute(1, 2, 0, 3, 4).contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    words = words.reshape(len(block_ids), len(heads), -1)
    weights = torch.arange(1, words.shape[-1] + 1, dtype=torch.int64, device=kv.device)
    s1 = words.sum(-1) % PRIME
    s2 = ((words * weights) % PRIME).sum(-1) % PRIME
    return torch.stack([s1, s2], dim=-1)


@triton.jit
def _block_sums_kernel(kv_ptr, block_ids_ptr, heads_ptr, out_ptr, stride_kv, stride_blk, stride_h, stride_tok,
                       num_heads, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0)
    j = tl.program_id(1)
    block = tl.load(block_ids_ptr + i).to(tl.int64)
    head = tl.load(heads_ptr + j).to(tl.int64)
    offs_t = tl.arange(0, PAGE_SIZE)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_d < HEAD_DIM)[None, :]
    base = kv_ptr + block * stride_blk + head * stride_h + offs_t[:, None] * stride_tok + offs_d[None, :]
    pos = (offs_t[:, None] * HEAD_DIM + offs_d[None, :]).to(tl.int64) + 1  # word index + 1 within K
    s1 = tl.zeros([], tl.int64)
    s2 = tl.zeros([], tl.int64)
    for half in range(2):  # K then V: V's words follow K's
        w = tl.load(base + half * stride_kv, mask=mask, other=0).to(tl.int64) & 0xFFFF
        s1 += tl.sum(tl.sum(w, 1), 0)
        # each term < 2^16 * 2^21 for slabs under 2M words: exact in int64 before the mod
        s2 += tl.sum(tl.sum((w * (pos + half * PAGE_SIZE * HEAD_DIM)) % 2147483647, 1), 0)
    base_out = out_ptr + (i * num_heads + j) * 2
    tl.store(base_out, s1 % 2147483647)
    tl.store(base_out + 1, s2 % 2147483647)


def kv_block_sums(kv: torch.Tensor, block_ids: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """int64 [len(block_ids), len(heads), 2]: (s1, s2) of each (block, head) slab (see above)."""
    check_kv(kv, kv.shape[4])
    if kv.element_size() != 2:
        raise ValueError(f"kv_block_sums reads 16-bit words, got {kv.dtype}")
    if next_power_of_2(kv.shape[3]) != kv.shape[3]:
        raise ValueError(f"block size {kv.shape[3]} is not a power of two")
    n, h = len(block_ids), len(heads)
    out = torch.empty(n, h, 2, dtype=torch.int64, device=kv.device)
    if n == 0 or h == 0:
        return out
    words = kv.view(torch.int16)
    _block_sums_kernel[(n, h)](
        words, block_ids, heads, out, words.stride(0), words.stride(1), words.stride(2), words.stride(3), h,
        PAGE_SIZE=kv.shape[3], HEAD_DIM=kv.shape[4], BLOCK_D=next_power_of_2(kv.shape[4]), num_warps=4,
    )
    return out
