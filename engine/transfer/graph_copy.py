"""Pool-to-pool handoff copies replayed from CUDA graphs: the host cost of a pull down to a
pinned write and one graph launch.

An 8k-token handoff of Llama-3.2-1B KV is ~130 µs of copying on the H200, and launching the
copy kernel from Python (checks, argument binding, launcher) cost 25-35 µs of it on top
(benchmarks/RESULTS.md, 2026-12-01). Between two fixed pools (the decode worker's own and a
peer's mapped over CUDA IPC) everything but the block run is the same from pull to pull, so one
launch is captured per (pool pair, layer range, head range, run-length bucket): the graph copies
a 1-row run table from pinned memory to the device, then runs the kernel over a grid sized for
the bucket (the next power of two of the run's length; rows past the run are masked off).

Safety: a graph bakes in addresses. It is keyed by every layer's address on both sides plus the
first layer's shape and strides (`kernels.pack._pair`), and used only with tensors the caller
passes now — so whatever memory those addresses name is live and laid out as captured. The
pinned run row is written only after the previous replay finished (pulls synchronise before they
return; a lock serialises callers of one graph). Capture is thread-local, so other threads'
CUDA work (an engine loop) goes on meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from splitserve.engine.transfer.plan import TransferOp

_MAX_GRAPHS = 32


class _GraphCopy:
    """One captured copy launch for a fixed pool pair, layer and head range, and run bucket."""

    def __init__(self, srcs, dsts, heads: tuple[int, int, int], bucket: int) -> None:
        from splitserve.kernels.pack import copy_head_block_runs

        device = dsts[0].device
        self.host = torch.zeros(1, 3, dtype=torch.int32, pin_memory=True)
        self.row = self.host.numpy()[0]
        table = torch.zeros(1, 3, dtype=torch.int32, device=device)
        self.lock = threading.Lock()
        # compile (and cache the launch state) outside the capture; a zero-length run writes nothing
        copy_head_block_runs(srcs, dsts, table, bucket, *heads)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream, capture_error_mode="thread_local"):
            table.copy_(self.host, non_blocking=True)
            copy_head_block_runs(srcs, dsts, table, bucket, *heads)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.table = table  # the graph reads it: kept alive with the graph
        self.done = torch.cuda.Event()
        self.done.record()

    def replay(self, src_block: int, dst_block: int, num_blocks: int) -> None:
        with self.lock:
            self.done.synchronize()  # the last replay has read the pinned row (at once after a pull)
            self.row[0], self.row[1], self.row[2] = src_block, dst_block, num_blocks
            self.graph.replay()
            self.done.record()


_GRAPHS: dict[tuple, _GraphCopy] = {}
_GRAPHS_LOCK = threading.Lock()


def copy_op_graph(op: TransferOp, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> bool:
    """Copy a single-run `op` between two long-lived pools through a captured graph, on the
    current stream. False (nothing done) when the op has several runs: the caller copies it."""
    if len(op.block_runs) != 1:
        return False
    from splitserve.kernels._common import next_power_of_2
    from splitserve.kernels.pack import pair_key

    run = op.block_runs[0]
    srcs = src[op.src_layer_start : op.src_layer_start + op.num_layers]
    dsts = dst[op.dst_layer_start : op.dst_layer_start + op.num_layers]
    heads = (op.src_head_start, op.dst_head_start, op.num_heads)
    bucket = next_power_of_2(run.num_blocks)
    key = (pair_key(srcs, dsts, *heads), bucket, dst[0].device.index)
    graph = _GRAPHS.get(key)
    if graph is None:
        with _GRAPHS_LOCK:
            graph = _GRAPHS.get(key)
            if graph is None:
                if len(_GRAPHS) >= _MAX_GRAPHS:
                    _GRAPHS.clear()
                graph = _GRAPHS[key] = _GraphCopy(srcs, dsts, heads, bucket)
    graph.replay(run.src_block, run.dst_block, run.num_blocks)
    return True
