"""Pack the slices a (src rank, dst rank) pair exchanges into one contiguous buffer, and back.

Buffer layout, ops in the order given, for each op its layers in order::

    [ op0 layer0: [2, nb, nh, block_size, head_dim] | op0 layer1: ... | op1 layer0: ... ]
                   │   │   └─ op.num_heads
                   │   └─ op's blocks in run order
                   └─ K, V

`pack_ops` reads the source side of each op (src layers / heads / blocks), `unpack_ops` writes the
destination side, so a buffer packed on the source unpacks on the destination whatever the two
layouts are. Plain torch: on a GPU one index_select / index_copy_ per op and layer (the reference
a fused kernel may replace); on the CPU one slice copy per block run instead, as torch's CPU
index_select walks the strided head slices element by element (~1-2 GB/s against ~10 for a copy).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.engine.transfer.layout import KVLayout
from splitserve.engine.transfer.plan import TransferOp


def op_numel(op: TransferOp, layout: KVLayout) -> int:
    """Elements `op` contributes to a packed buffer."""
    return op.num_layers * 2 * op.num_blocks * op.num_heads * layout.block_size * layout.head_dim


def packed_numel(ops: Sequence[TransferOp], layout: KVLayout) -> int:
    """Elements of the buffer `pack_ops(ops, ...)` returns."""
    return sum(op_numel(op, layout) for op in ops)


def _chunks(buffer: torch.Tensor, op: TransferOp, layout: KVLayout, offset: int):
    shape = (2, op.num_blocks, op.num_heads, layout.block_size, layout.head_dim)
    size = 2 * op.num_blocks * op.num_heads * layout.block_size * layout.head_dim
    for i in range(op.num_layers):
        yield i, buffer[offset + i * size: offset + (i + 1) * size].view(shape)


def pack_ops(
    ops: Sequence[TransferOp], layout: KVLayout, kv_tensors: Sequence[torch.Tensor],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather the source side of `ops` from `kv_tensors` (the source rank's) into a 1-D buffer."""
    numel = packed_numel(ops, layout)
    if out is None:
        out = torch.empty(numel, dtype=kv_tensors[0].dtype, device=kv_tensors[0].device)
    elif out.shape != (numel,) or out.dtype != kv_tensors[0].dtype:
        raise ValueError(f"pack buffer is {tuple(out.shape)} {out.dtype}, expected ({numel},) {kv_tensors[0].dtype}")
    offset = 0
    for op in ops:
        heads = slice(op.src_head_start, op.src_head_start + op.num_heads)
        idx = None if out.device.type == "cpu" else torch.as_tensor(op.src_blocks(), dtype=torch.long, device=out.device)
        for i, chunk in _chunks(out, op, layout, offset):
            kv = kv_tensors[op.src_layer_start + i]
            if idx is not None:
                torch.index_select(kv[:, :, heads], 1, idx, out=chunk)
                continue
            k = 0
            for run in op.block_runs:
                chunk[:, k:k + run.num_blocks].copy_(kv[:, run.src_block:run.src_block + run.num_blocks, heads])
                k += run.num_blocks
        offset += op_numel(op, layout)
    return out


def unpack_ops(
    buffer: torch.Tensor, ops: Sequence[TransferOp], layout: KVLayout, kv_tensors: Sequence[torch.Tensor]
) -> None:
    """Scatter a buffer made by `pack_ops(ops, ...)` into the destination side of `ops`."""
    numel = packed_numel(ops, layout)
    if buffer.shape != (numel,) or buffer.dtype != kv_tensors[0].dtype:
        raise ValueError(
            f"unpack buffer is {tuple(buffer.shape)} {buffer.dtype}, expected ({numel},) {kv_tensors[0].dtype}"
        )
    offset = 0
    for op in ops:
        heads = slice(op.dst_head_start, op.dst_head_start + op.num_heads)
        idx = None if buffer.device.type == "cpu" else torch.as_tensor(op.dst_blocks(), dtype=torch.long,
                                                                          device=buffer.device)
        for i, chunk in _chunks(buffer, op, layout, offset):
            kv = kv_tensors[op.dst_layer_start + i]
            if idx is not None:
                kv[:, :, heads].index_copy_(1, idx, chunk)
                continue
            k = 0
            for run in op.block_runs:
                kv[:, run.dst_block:run.dst_block + run.num_blocks, heads].copy_(chunk[:, k:k + run.num_blocks])
                k += run.num_blocks
        offset += op_numel(op, layout)
