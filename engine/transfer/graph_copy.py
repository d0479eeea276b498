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

import itertools
import threading
from collections.abc import Sequence
from operator import is_

import torch

from splitserve.engine.transfer.plan import TransferOp
from splitserve.kernels._common import next_power_of_2

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

    def replay(self, src_block: int, dst_block: int, num_blocks: int, stream: torch.cuda.Stream | None) -> None:
        with self.lock:
            self.done.synchronize()  # the last replay has read the pinned row (at once after a pull)
            self.row[0], self.row[1], self.row[2] = src_block, dst_block, num_blocks
            self.graph.replay()
            # the caller's current stream when it has it: Event.record() looks it up through
            # torch.cuda.current_stream(), ~3 µs of Python (gpu_copy.current_stream)
            self.done.record(stream)


_GRAPHS: dict[tuple, _GraphCopy] = {}
_GRAPHS_LOCK = threading.Lock()
_DATA_PTR = torch.Tensor.data_ptr


def pools_key(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> tuple:
    """Every layer's address, shape, stride and dtype on both sides: equal keys name the same
    memory laid out the same way (while the tensors are alive)."""

    def side(ts):
        return tuple((_DATA_PTR(t), t.shape, t.stride(), t.dtype, t.device) for t in ts)

    return side(src), side(dst)


_TOKENS: dict[tuple, int] = {}
_TOKENS_LOCK = threading.Lock()
_NEXT_TOKEN = itertools.count()


def pools_token(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> int:
    """A small int standing for `pools_key(src, dst)`: graphs are looked up by it, and hashing
    the nested key itself cost microseconds per pull. A token is never given to another key
    (forgetting the table only means new tokens for old keys, whose graphs then age out)."""
    key = pools_key(src, dst)
    with _TOKENS_LOCK:
        token = _TOKENS.get(key)
        if token is None:
            if len(_TOKENS) >= 4 * _MAX_GRAPHS:
                _TOKENS.clear()
            token = _TOKENS[key] = next(_NEXT_TOKEN)
    return token


class PoolPairKeys:
    """`pools_token` of the (source, destination) pool lists a transport pulls between, worked
    out once per pair of list objects: the key walks 32 tensors (~8 µs of Python at 16 layers,
    ~5% of an 8k-token H200 pull), while the lists come back unchanged pull after pull (the
    peer's mapped pool, the worker's own). A remembered token is used only while both lists
    hold the very tensor objects it was worked out from (identity, C-speed); a pool tensor is
    never re-pointed in place (`set_`), so the same objects mean the same addresses. The lists
    are held so their ids cannot be reused; `limit` pairs at most."""

    def __init__(self, limit: int = 8) -> None:
        self._limit = limit
        self._memo: dict[tuple[int, int], tuple] = {}

    def key(self, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> int:
        ident = (id(src), id(dst))
        memo = self._memo.get(ident)
        if (
            memo is not None
            and memo[0] is src
            and memo[1] is dst
            and len(src) == len(memo[2])
            and len(dst) == len(memo[3])
            and all(map(is_, src, memo[2]))
            and all(map(is_, dst, memo[3]))
        ):
            return memo[4]
        if len(self._memo) >= self._limit:
            self._memo.clear()
        token = pools_token(src, dst)
        self._memo[ident] = (src, dst, tuple(src), tuple(dst), token)
        return token

    def clear(self) -> None:
        self._memo.clear()


def copy_op_graph(
    op: TransferOp, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], pools: int | None = None,
    stream: torch.cuda.Stream | None = None,
) -> bool:
    """Copy a single-run `op` between two long-lived pools through a captured graph, on the
    current stream. False (nothing done) when the op has several runs: the caller copies it.
    `pools`: `pools_token(src, dst)` when the caller has it (`PoolPairKeys`), else worked out here;
    `stream`: the current stream when the caller has it (`gpu_copy.current_stream`)."""
    if len(op.block_runs) != 1:
        return False
    run = op.block_runs[0]
    bucket = next_power_of_2(run.num_blocks)
    if pools is None:
        pools = pools_token(src, dst)
    key = (pools, op.src_layer_start, op.dst_layer_start, op.num_layers, op.src_head_start, op.dst_head_start,
           op.num_heads, bucket)
    graph = _GRAPHS.get(key)
    if graph is None:
        with _GRAPHS_LOCK:
            graph = _GRAPHS.get(key)
            if graph is None:
                if len(_GRAPHS) >= _MAX_GRAPHS:
                    _GRAPHS.clear()
                srcs = src[op.src_layer_start : op.src_layer_start + op.num_layers]
                dsts = dst[op.dst_layer_start : op.dst_layer_start + op.num_layers]
                heads = (op.src_head_start, op.dst_head_start, op.num_heads)
                graph = _GRAPHS[key] = _GraphCopy(srcs, dsts, heads, bucket)
    graph.replay(run.src_block, run.dst_block, run.num_blocks, stream)
    return True
