"""Random paged caches for the kernel tests, built from dense per-sequence K/V.

Blocks are handed out in a random order (block tables are non-contiguous and
unsorted); every slot no sequence owns holds POISON, so a kernel that reads past
a context, or through a padded block-table entry, gives a visibly wrong answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

POISON = 300.0


@dataclass
class PagedCase:
    kv: torch.Tensor
    """[2, NB, Hkv, BS, D]"""
    block_tables: torch.Tensor
    """[S, max_blocks], padded with random block ids (also other sequences' blocks)."""
    ctx_lens: torch.Tensor
    """[S]"""
    keys: list[torch.Tensor]
    """per sequence [ctx_len, Hkv, D], what was written into the cache"""
    values: list[torch.Tensor]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def random_paged_case(
    ctx_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    seed: int = 0,
    index_dtype: torch.dtype = torch.int32,
    pad_blocks: int = 2,
    spare_blocks: int = 3,
) -> PagedCase:
    g = torch.Generator().manual_seed(seed)
    needed = [cdiv(n, block_size) for n in ctx_lens]
    num_blocks = sum(needed) + spare_blocks
    max_blocks = max(needed, default=0) + pad_blocks
    order = torch.randperm(num_blocks, generator=g)
    kv = torch.full((2, num_blocks, num_kv_heads, block_size, head_dim), POISON, dtype=dtype)
    block_tables = torch.randint(0, num_blocks, (len(ctx_lens), max_blocks), generator=g)
    keys, values = [], []
    used = 0
    for s, n in enumerate(ctx_lens):
        blocks = order[used : used + needed[s]]
        used += needed[s]
        block_tables[s, : needed[s]] = blocks
        k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        t = torch.arange(n)
        kv[0, blocks[t // block_size], :, t % block_size] = k
        kv[1, blocks[t // block_size], :, t % block_size] = v
        keys.append(k.to(device))
        values.append(v.to(device))
    return PagedCase(
        kv.to(device),
        block_tables.to(index_dtype).to(device),
        torch.tensor(ctx_lens, dtype=index_dtype, device=device),
        keys,
        values,
    )


def tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 3e-2}[dtype]
