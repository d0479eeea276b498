"""Checks that a rank's KV tensors match its `KVLayout` before any transfer reads or writes them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.engine.transfer.layout import KVLayout


def torch_dtype(layout: KVLayout) -> torch.dtype:
    """The torch dtype named by `layout.dtype`."""
    return getattr(torch, layout.dtype)


def check_kv_tensors(kv_tensors: Sequence[torch.Tensor], layout: KVLayout, rank: int) -> int:
    """Validate rank `rank`'s per-layer tensors and return the pool size (blocks per tensor).

    Each must be contiguous, of `layout`'s dtype, shaped `[2, P, num_local_heads, block_size,
    head_dim]` with the same P and device for every local layer.
    """
    expected_layers = layout.num_local_layers(layout.pp_rank(rank))
    if len(kv_tensors) != expected_layers:
        raise ValueError(
            f"rank {rank} has {len(kv_tensors)} KV tensors, its stage holds {expected_layers} layers "
            f"({layout.describe()})"
        )
    if not kv_tensors:
        raise ValueError(f"rank {rank} has no KV tensors")
    dtype = torch_dtype(layout)
    pool = kv_tensors[0].shape[1] if kv_tensors[0].dim() == 5 else -1
    device = kv_tensors[0].device
    for i, t in enumerate(kv_tensors):
        expected = layout.kv_shape(pool)
        if tuple(t.shape) != expected or pool < 1:
            raise ValueError(f"rank {rank} KV tensor {i} has shape {tuple(t.shape)}, expected {expected}")
        if t.dtype != dtype:
            raise ValueError(f"rank {rank} KV tensor {i} has dtype {t.dtype}, layout says {layout.dtype}")
        if t.device != device:
            raise ValueError(f"rank {rank} KV tensor {i} is on {t.device}, tensor 0 on {device}")
        if not t.is_contiguous():
            raise ValueError(f"rank {rank} KV tensor {i} is not contiguous; transports address raw memory")
    return pool
