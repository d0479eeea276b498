"""Move one transfer-plan op between CUDA tensors this process can address (its own pool, a
peer's pool mapped over CUDA IPC, a staging buffer): one Triton launch for every layer and
block run of the op (kernels/pack.py), with the runs as a small int32 table copied from
pinned memory.

Measured on the H200 (benchmarks/RESULTS.md, 2026-12-01), 8k tokens of Llama-3.2-1B KV
(268 MB), against a same-size device memcpy of ~130 µs: the kernel itself runs at 88-93% of
the memcpy; the host work before it starts (~25-35 µs once the run table, per-pool checks and
Triton's argument binding were cut) is what remains: a whole pull is 81% of a memcpy at 8k
tokens, 88% at 32k. Rejected: one torch slice copy per (layer, run) (~20 µs of Python
each: 34%), and one `cudaMemcpyAsync` / `cudaMemcpy2DAsync` per (layer, K/V, run) through the
CUDA runtime (slower than the kernel on IPC-mapped memory, and 2-D copies of head-range rows
ran at a quarter of the memcpy).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from splitserve.engine.transfer.plan import TransferOp

_STREAMS: dict[tuple, torch.cuda.Stream] = {}
_RAW_LOOKUP = getattr(torch._C, "_cuda_getCurrentStream", None)


def current_stream(index: int) -> torch.cuda.Stream:
    """`torch.cuda.current_stream(index)` without building a new Stream object per call: that
    cost ~3 µs of Python on the H200 host (~2% of an 8k-token pull, benchmarks/RESULTS.md
    2026-12-02 session 6); the raw (id, device, type) lookup underneath costs 0.25 µs."""
    if _RAW_LOOKUP is None:  # a torch without the private lookup: the public call
        return torch.cuda.current_stream(index)
    raw = _RAW_LOOKUP(index)
    stream = _STREAMS.get(raw)
    if stream is None:
        if len(_STREAMS) >= 64:
            _STREAMS.clear()
        stream = _STREAMS[raw] = torch.cuda.current_stream(index)
    return stream


def runs_table(op: TransferOp, device: torch.device) -> torch.Tensor:
    """int32 [runs, 3] (src_block, dst_block, num_blocks) on `device`, via pinned memory (the
    caching host allocator keeps the buffer until the asynchronous copy has read it)."""
    flat = array("i")
    for run in op.block_runs:
        flat.extend((run.src_block, run.dst_block, run.num_blocks))
    pinned = torch.empty(len(flat), dtype=torch.int32, pin_memory=True)
    pinned.copy_(torch.frombuffer(flat, dtype=torch.int32))
    return pinned.view(-1, 3).to(device, non_blocking=True)


def copy_op_cuda(op: TransferOp, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> None:
    """Copy `op` from `src` (its source-side layer tensors) to `dst` (its destination side), on
    the current stream; the caller synchronises before the data is used by another process."""
    from splitserve.kernels.pack import copy_head_block_runs

    if not op.block_runs:
        return
    srcs = src[op.src_layer_start : op.src_layer_start + op.num_layers]
    dsts = dst[op.dst_layer_start : op.dst_layer_start + op.num_layers]
    if len(op.block_runs) == 1:  # the common case (a fresh prompt's blocks): scalars, no table
        run = op.block_runs[0]
        runs, longest = (run.src_block, run.dst_block, run.num_blocks), run.num_blocks
    else:
        runs, longest = runs_table(op, dst[0].device), max(run.num_blocks for run in op.block_runs)
    copy_head_block_runs(srcs, dsts, runs, longest, op.src_head_start, op.dst_head_start, op.num_heads)
