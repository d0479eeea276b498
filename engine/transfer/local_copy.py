"""Copy one plan op between tensors this process can address (a mapped peer pool, a staging
buffer, its own pool): the local half of the shm transport and of NIXL's staged reshard pulls."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.engine.transfer.plan import TransferOp

MAX_SLICE_RUNS = 8
"""An op with more block runs than this is moved with one gather + one scatter per layer
(two passes, no Python loop over runs) instead of one slice copy per run."""


def copy_op(op: TransferOp, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> None:
    """Copy `op` from `src` (its source-side tensors) to `dst` (its destination-side tensors).

    CUDA with Triton: the pack kernel, one launch for every layer of the op. Otherwise (CPU), few runs: one
    strided slice copy per (layer, run) — a reshard's head slice is just a stride; many runs
    (scattered block ids): gather + scatter per layer.
    """
    if dst[0].is_cuda and _has_kernel():  # one launch for all layers and runs (kernels/pack.py)
        from splitserve.kernels.pack import copy_head_blocks, copy_head_blocks_layers

        src_idx = torch.as_tensor(op.src_blocks(), dtype=torch.int32).to(dst[0].device, non_blocking=True)
        dst_idx = torch.as_tensor(op.dst_blocks(), dtype=torch.int32).to(dst[0].device, non_blocking=True)
        srcs = [src[op.src_layer_start + i] for i in range(op.num_layers)]
        dsts = [dst[op.dst_layer_start + i] for i in range(op.num_layers)]
        heads = (op.src_head_start, op.dst_head_start, op.num_heads)
        try:
            copy_head_blocks_layers(srcs, dsts, src_idx, dst_idx, *heads)
        except ValueError:  # layers not mutually aligned: one launch per layer
            for s, d in zip(srcs, dsts, strict=True):
                copy_head_blocks(s, d, src_idx, dst_idx, *heads)
        return
    sh = slice(op.src_head_start, op.src_head_start + op.num_heads)
    dh = slice(op.dst_head_start, op.dst_head_start + op.num_heads)
    many = len(op.block_runs) > MAX_SLICE_RUNS
    if many:
        device = dst[0].device
        src_idx = torch.as_tensor(op.src_blocks(), dtype=torch.long, device=device)
        dst_idx = torch.as_tensor(op.dst_blocks(), dtype=torch.long, device=device)
    for i in range(op.num_layers):
        s, d = src[op.src_layer_start + i], dst[op.dst_layer_start + i]
        if many:
            d[:, :, dh].index_copy_(1, dst_idx, s[:, :, sh].index_select(1, src_idx))
            continue
        for run in op.block_runs:
            d[:, run.dst_block: run.dst_block + run.num_blocks, dh].copy_(
                s[:, run.src_block: run.src_block + run.num_blocks, sh])


def _has_kernel() -> bool:
    from splitserve import kernels

    return kernels.triton_available()
