"""Copy one plan op between tensors this process can address (a mapped peer pool, a staging
buffer, its own pool): the local half of the shm transport and of NIXL's staged reshard pulls."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from splitserve.engine.transfer.plan import TransferOp

MAX_SLICE_RUNS = 8
"""An op with more block runs than this is moved with one gather + one scatter per layer
(two passes, no Python loop over runs) instead of one slice copy per run."""


def copy_op(op: TransferOp, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> None:
    """Copy `op` from `src` (its source-side tensors) to `dst` (its destination-side tensors).

    CUDA with Triton: the pack kernel, one launch for every layer of the op. Otherwise, few runs:
    one strided slice copy per (layer, run) — a reshard's head slice is just a stride — through
    numpy when that slice cuts CPU blocks into pieces (`_copy_runs_host`), else torch; many runs
    (scattered block ids): gather + scatter per layer.
    """
    if dst[0].is_cuda and _has_kernel():  # one launch for all layers and runs (kernels/pack.py)
        from splitserve.engine.transfer.gpu_copy import copy_op_cuda

        copy_op_cuda(op, src, dst)
        return
    sh = slice(op.src_head_start, op.src_head_start + op.num_heads)
    dh = slice(op.dst_head_start, op.dst_head_start + op.num_heads)
    if len(op.block_runs) > MAX_SLICE_RUNS:
        _gather_scatter(op, src, dst, sh, dh)
    elif _host_pieces(op, src, dst):
        _copy_runs_host(op, src, dst, sh, dh)
    else:
        _copy_runs_torch(op, src, dst, sh, dh)


def _host_pieces(op: TransferOp, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> bool:
    """Both sides on CPU and the op takes a strict part of the kv heads on either side: each block
    run is then a stride of per-block pieces, not one contiguous span per K|V."""
    s, d = src[op.src_layer_start], dst[op.dst_layer_start]
    return s.is_cpu and d.is_cpu and op.num_heads < max(s.shape[2], d.shape[2])


def _copy_runs_torch(
    op: TransferOp, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], sh: slice, dh: slice
) -> None:
    """One torch slice copy per (layer, run)."""
    for i in range(op.num_layers):
        s, d = src[op.src_layer_start + i], dst[op.dst_layer_start + i]
        for run in op.block_runs:
            d[:, run.dst_block : run.dst_block + run.num_blocks, dh].copy_(
                s[:, run.src_block : run.src_block + run.num_blocks, sh]
            )


def _copy_runs_host(
    op: TransferOp, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], sh: slice, dh: slice
) -> None:
    """One numpy slice assignment per (layer, run) on byte views of the CPU tensors.

    numpy merges the dimensions that are contiguous on both sides and moves each contiguous
    piece (a block's head slice: 8 KiB for Llama-3.2-1B tp1 → tp2) with one libc `memmove`
    (`rep movsb` at that size); torch's copy kernel runs its own vector loop per piece, ~8-10%
    slower on one thread for 4-16 KiB pieces (two processes, 1k-32k tokens), and costs ~8 µs
    of dispatch per call against ~5 µs here (the two byte views included). Whole-head runs (one
    MB-sized span per K|V) stay on torch: there libc's large-copy loop was ~3% slower. Byte
    views keep it dtype-agnostic (bf16, fp8 have no numpy dtype): only the last dimension
    (head_dim) changes its unit, the block and head dimensions stay.
    """
    runs = [
        (
            (slice(None), slice(run.dst_block, run.dst_block + run.num_blocks), dh),
            (slice(None), slice(run.src_block, run.src_block + run.num_blocks), sh),
        )
        for run in op.block_runs
    ]
    srcs = src[op.src_layer_start : op.src_layer_start + op.num_layers]
    dsts = dst[op.dst_layer_start : op.dst_layer_start + op.num_layers]
    for s_layer, d_layer in zip(srcs, dsts, strict=True):
        s, d = _host_bytes(s_layer), _host_bytes(d_layer)
        for d_index, s_index in runs:
            d[d_index] = s[s_index]


def _host_bytes(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor with a contiguous last dimension as a numpy uint8 array over the same memory
    (KV tensors never require grad; `numpy()` refuses one that does)."""
    return t.view(torch.uint8).numpy()


def _gather_scatter(
    op: TransferOp, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], sh: slice, dh: slice
) -> None:
    """Scattered block ids: one index_select + index_copy_ per layer, no Python loop over runs.
    On byte views: a bitwise copy, and torch has no CPU index_copy_ for float8."""
    device = dst[0].device
    src_idx = torch.as_tensor(op.src_blocks(), dtype=torch.long, device=device)
    dst_idx = torch.as_tensor(op.dst_blocks(), dtype=torch.long, device=device)
    for i in range(op.num_layers):
        s = src[op.src_layer_start + i].view(torch.uint8)
        d = dst[op.dst_layer_start + i].view(torch.uint8)
        d[:, :, dh].index_copy_(1, dst_idx, s[:, :, sh].index_select(1, src_idx))


def _has_kernel() -> bool:
    from splitserve import kernels

    return kernels.triton_available()
