"""Sizing and allocating one rank's paged KV cache.

Per local layer: `kv[2, num_blocks, num_kv_heads_local, block_size, head_dim]`
(see `attention.py`). All ranks of an engine must agree on `num_blocks`
(they share block ids), so the count is derived from the largest pipeline
stage, not from this rank's own layers.
"""

from __future__ import annotations

import torch

from splitserve.engine.config import CacheConfig
from splitserve.engine.host_memory import huge_page_zeros
from splitserve.engine.models.config import ModelConfig
from splitserve.engine.parallel import ParallelState, kv_heads_of_rank, stage_layer_range


def bytes_per_block(model: ModelConfig, ps: ParallelState, cache: CacheConfig, dtype: torch.dtype) -> int:
    """Bytes one block costs on the rank with the most layers."""
    max_stage_layers = max(
        end - start
        for start, end in (
            model.kv_layer_range(*stage_layer_range(model.num_layers, ps.pp_size, s)) for s in range(ps.pp_size)
        )
    )
    max_stage_layers = max(1, max_stage_layers)
    start, end = kv_heads_of_rank(model.num_kv_heads, ps.tp_size, ps.tp_rank)
    elem = torch.empty((), dtype=dtype).element_size()
    return max_stage_layers * 2 * (end - start) * cache.block_size_tokens * model.head_dim * elem


def num_blocks_for(model: ModelConfig, ps: ParallelState, cache: CacheConfig, dtype: torch.dtype) -> int:
    if cache.num_blocks is not None:
        return cache.num_blocks
    num = int(cache.buffer_size_gb * 1024**3) // bytes_per_block(model, ps, cache, dtype)
    if num < 1:
        raise ValueError(f"buffer_size_gb={cache.buffer_size_gb} holds no KV block of this model")
    return num


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, ...]:
    """Zeroed KV tensors, one per local layer. Zeroed, not `empty`: masked-out
    padding still enters the dot products, and a NaN there would poison them. On the CPU they
    ask for transparent huge pages: other processes read them (host_memory.py says why). A
    tuple: the pool's layer list never changes, and a GPU handoff trusts a tuple's identity
    (engine/transfer/graph_copy.py::PoolPairKeys)."""
    shape = (2, num_blocks, num_kv_heads, block_size, head_dim)
    if torch.device(device).type == "cpu":
        return tuple(huge_page_zeros(shape, dtype) for _ in range(num_layers))
    return tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers))
