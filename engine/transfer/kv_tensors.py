"""Checks that a rank's KV tensors match its `KVLayout` before any transfer reads or writes them.

Every pull and push checks, and a decode worker pulls into the same pool tensors request after
request: the full walk over 16 layers (shape, dtype, device, contiguity) measured ~10-20 µs of
Python on the H200 host, as long as a tenth of an 8k-token same-host GPU copy (benchmarks/
RESULTS.md, 2026-12-03 session 12). So a passed check is remembered for the very tensor objects
it was made on (weak references: a freed pool is not kept alive, and a new tensor is checked
anew) and the same layout. Everything the check reads (shape, strides, dtype, device) changes on
the same object only through `set_` / `Tensor.resize_`, which the engine never calls on a pool
(suspend / resume resize the storage underneath, which leaves all of it as it was).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from splitserve.engine.transfer.layout import KVLayout

_MEMO_LIMIT = 16
_PASSED: dict[tuple[int, int, int], tuple[tuple[weakref.ref, ...], KVLayout, int]] = {}


def torch_dtype(layout: KVLayout) -> torch.dtype:
    """The torch dtype named by `layout.dtype`."""
    return getattr(torch, layout.dtype)


def check_kv_tensors(kv_tensors: Sequence[torch.Tensor], layout: KVLayout, rank: int) -> int:
    """Validate rank `rank`'s per-layer tensors and return the pool size (blocks per tensor).

    Each must be contiguous, of `layout`'s dtype, shaped `[2, P, num_local_heads, block_size,
    head_dim]` with the same P and device for every local layer.
    """
    if not kv_tensors:
        return _check(kv_tensors, layout, rank)  # raises
    key = (id(kv_tensors[0]), len(kv_tensors), rank)
    memo = _PASSED.get(key)
    if memo is not None and (memo[1] is layout or memo[1] == layout) and all(
        ref() is t for ref, t in zip(memo[0], kv_tensors, strict=True)
    ):
        return memo[2]
    pool = _check(kv_tensors, layout, rank)
    if len(_PASSED) >= _MEMO_LIMIT:
        _PASSED.clear()
    _PASSED[key] = (tuple(weakref.ref(t) for t in kv_tensors), layout, pool)
    return pool


class HeldPoolCheck:
    """`check_kv_tensors` for an owner that pulls into the same pool tuple over and over (a
    transport's destination pool): the last tuple that passed is *held* here, so its id cannot be
    reused while remembered, and a tuple cannot change — the same tuple, layout and rank skip even
    the memo's weakref walk (~1.5 µs at 16 layers of a ~35 µs 1k-token GPU pull, benchmarks/
    RESULTS.md 2026-12-04 session 18). Lists go through `check_kv_tensors` every time."""

    def __init__(self) -> None:
        self._last: tuple = ()

    def __call__(self, kv_tensors: Sequence[torch.Tensor], layout: KVLayout, rank: int) -> int:
        last = self._last
        if last and last[0] is kv_tensors and last[2] == rank and (last[1] is layout or last[1] == layout):
            return last[3]
        pool = check_kv_tensors(kv_tensors, layout, rank)
        self._last = (kv_tensors, layout, rank, pool) if type(kv_tensors) is tuple else ()
        return pool

    def clear(self) -> None:
        self._last = ()


def _check(kv_tensors: Sequence[torch.Tensor], layout: KVLayout, rank: int) -> int:
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
    expected = layout.kv_shape(pool)
    for i, t in enumerate(kv_tensors):
        if tuple(t.shape) != expected or pool < 1:
            raise ValueError(f"rank {rank} KV tensor {i} has shape {tuple(t.shape)}, expected {expected}")
        if t.dtype != dtype:
            raise ValueError(f"rank {rank} KV tensor {i} has dtype {t.dtype}, layout says {layout.dtype}")
        if t.device != device:
            raise ValueError(f"rank {rank} KV tensor {i} is on {t.device}, tensor 0 on {device}")
        if not t.is_contiguous():
            raise ValueError(f"rank {rank} KV tensor {i} is not contiguous; transports address raw memory")
    return pool
