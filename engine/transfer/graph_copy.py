"""Pool-to-pool handoff copies replayed from CUDA graphs: the host cost of a pull down to
setting three kernel arguments and one graph launch.

An 8k-token handoff of Llama-3.2-1B KV is ~130 µs of copying on the H200, and launching the
copy kernel from Python (checks, argument binding, launcher) cost 25-35 µs of it on top
(benchmarks/RESULTS.md, 2026-12-01). Between two fixed pools (the decode worker's own and a
peer's mapped over CUDA IPC) everything but the block run is the same from pull to pull, so one
launch is captured per (pool pair, layer range, head range, run-length bucket), over a grid
sized for the bucket (the next power of two of the run's length; rows past the run are masked
off). The run reaches the kernel as its scalar arguments, rewritten in the executable graph per
launch (graph_node.py); where that cannot be done, the graph copies a 1-row run table from
pinned memory to the device first (~4 µs more per pull on the H200: a tenth of a 1k-token one).

Safety: a graph bakes in addresses. It is keyed by every layer's address on both sides plus the
first layer's shape and strides (`kernels.pack._pair`), and used only with tensors the caller
passes now — so whatever memory those addresses name is live and laid out as captured. A
graph's arguments are set and launched by one pull at a time (its lock; an update does not touch
launches already queued). The pinned run row of a memcpy-node graph is written only by the pull
that holds the graph's lock, and that pull keeps it until its copies have run (it synchronises
its stream, then releases); a pull that finds a graph taken copies directly instead of waiting.
Capture is thread-local, so other threads' CUDA work (an engine loop) goes on meanwhile.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from operator import is_

import torch

from splitserve.engine.transfer.gpu_copy import current_stream
from splitserve.engine.transfer.graph_node import ScalarGraph, capture_graph
from splitserve.engine.transfer.plan import TransferOp
from splitserve.kernels._common import next_power_of_2

log = logging.getLogger(__name__)

_MAX_GRAPHS = 32


_SENTINELS = (0x2F3A5C17, 0x3B1D4E29, 0x1C6E7A30)
"""Run values the argument-rewriting graph is captured with, to find their slots: no real run
has them (block ids of that size would be terabytes of KV). The length is a multiple of 16 like
the zero-length warm-up run's, so both share one specialisation of the launch."""


class _GraphCopy:
    """One captured copy launch for a fixed pool pair, layer and head range, and run bucket."""

    def __init__(self, srcs, dsts, heads: tuple[int, int, int], bucket: int) -> None:
        from splitserve.kernels.pack import NUM_WARPS, copy_grid, copy_head_block_runs

        self.lock = threading.Lock()
        """Held by one pull while it sets and launches the graph; for a memcpy-node graph, from
        before it writes the pinned row until its copies have run."""
        self.scalar = None
        device = dsts[0].device
        try:  # the run as kernel arguments (graph_node.py); compiled outside the capture first
            with torch.cuda.device(device):
                copy_head_block_runs(srcs, dsts, (*_SENTINELS[:2], 0), 0, *heads, grid_blocks=bucket)
                self.scalar = ScalarGraph(
                    lambda s0, d0, n: copy_head_block_runs(srcs, dsts, (s0, d0, n), 0, *heads, grid_blocks=bucket),
                    _SENTINELS, copy_grid(1, bucket, len(srcs)), NUM_WARPS)
            return
        except Exception as exc:  # noqa: BLE001 - any failure: the memcpy-node graph below
            _note_fallback(exc)
        self.host = torch.zeros(1, 3, dtype=torch.int32, pin_memory=True)
        self.row = self.host.numpy()[0]
        table = torch.zeros(1, 3, dtype=torch.int32, device=device)
        # compile (and cache the launch state) outside the capture; a zero-length run writes nothing
        copy_head_block_runs(srcs, dsts, table, bucket, *heads)

        def replay_body() -> None:
            table.copy_(self.host, non_blocking=True)
            copy_head_block_runs(srcs, dsts, table, bucket, *heads)

        self.graph = capture_graph(replay_body, device)
        self.table = table  # the graph reads it: kept alive with the graph


_FALLBACK_NOTED: list[str] = []


def _note_fallback(exc: Exception) -> None:
    if not _FALLBACK_NOTED:
        _FALLBACK_NOTED.append(str(exc))
        log.info("handoff copy graphs pass runs through a memcpy node (~4 µs more per pull): %s", exc)


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


_GENERATION = [0]
"""Bumped by `forget_pools`: remembered pool-pair tokens of an older generation are not trusted."""


def forget_pools() -> None:
    """Drop every captured copy graph and pool token, and make every `PoolPairKeys` work its pairs
    out again. Called when a KV pool's tensors keep their objects but not their memory: a lifecycle
    suspend frees the storage and a resume allocates it anew (engine/lifecycle.py), so a pool list
    holding the very same tensor objects may name other addresses than the ones a graph baked in."""
    with _GRAPHS_LOCK:
        _GENERATION[0] += 1
        _GRAPHS.clear()
    with _TOKENS_LOCK:
        _TOKENS.clear()


class PoolPairKeys:
    """`pools_token` of the (source, destination) pool lists a transport pulls between, worked
    out once per pair of list objects: the key walks 32 tensors (~8 µs of Python at 16 layers,
    ~5% of an 8k-token H200 pull), while the lists come back unchanged pull after pull (the
    peer's mapped pool, the worker's own). A remembered token is used only while both lists
    hold the very tensor objects it was worked out from (identity, C-speed; for tuples, which
    cannot change, the tuple's identity is enough: ~2.5 µs less per pull on the H200 host) and
    no `forget_pools` came since: a pool tensor's storage is re-allocated only by a lifecycle
    resume, which calls it. The lists are held so their ids cannot be reused; `limit` pairs at
    most."""

    def __init__(self, limit: int = 8) -> None:
        self._limit = limit
        self._memo: dict[tuple[int, int], tuple] = {}

    def key(self, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> int:
        memo = self._memo.get((id(src), id(dst)))
        if memo is not None and memo[0] is src and memo[1] is dst and memo[5] == _GENERATION[0]:
            if type(src) is tuple and type(dst) is tuple:
                return memo[4]
            if (
                len(src) == len(memo[2])
                and len(dst) == len(memo[3])
                and all(map(is_, src, memo[2]))
                and all(map(is_, dst, memo[3]))
            ):
                return memo[4]
        if len(self._memo) >= self._limit:
            self._memo.clear()
        generation = _GENERATION[0]
        token = pools_token(src, dst)
        self._memo[(id(src), id(dst))] = (src, dst, tuple(src), tuple(dst), token, generation)
        return token

    def clear(self) -> None:
        self._memo.clear()


def copy_op_graph(
    op: TransferOp, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], held: list[_GraphCopy],
    pools: int | None = None, stream: torch.cuda.Stream | None = None,
) -> bool:
    """Copy a single-run `op` between two long-lived pools through a captured graph, on the
    destination device's current stream (`stream`: that stream, when the caller has it). False
    (nothing done) when the op has several runs, or when another pull is launching the same
    graph right now: the caller copies it directly.

    A memcpy-node graph's pinned run row may be rewritten only after the replay that read it has
    run, so its lock is taken here (without waiting: no lock order to get wrong between pulls)
    and put in `held`; the caller synchronises the stream its copies ran on and then calls
    `release(held)` — also when it fails. This costs no CUDA event per replay (an event record
    and query were ~3 µs of a ~34 µs 1k-token pull on the H200 host). An argument-rewriting
    graph's lock is given back as soon as it is launched (nothing the next launch writes is read
    by this one); it goes into `held` only to stay alive until the caller has synchronised (a
    full graph cache may drop it meanwhile).
    `pools`: `pools_token(src, dst)` when the caller has it (`PoolPairKeys`), else worked out here."""
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
    if not graph.lock.acquire(blocking=False):
        return False
    if graph.scalar is not None:
        try:
            graph.scalar.launch((run.src_block, run.dst_block, run.num_blocks),
                                stream or current_stream(dst[0].get_device()))
        finally:
            graph.lock.release()
        held.append(graph)
        return True
    held.append(graph)
    row = graph.row
    row[0], row[1], row[2] = run.src_block, run.dst_block, run.num_blocks
    graph.graph.replay()
    return True


def release(held: list[_GraphCopy]) -> None:
    """Give back the graphs `copy_op_graph` took, once the stream their replays ran on has been
    synchronised."""
    while held:
        graph = held.pop()
        if graph.scalar is None:  # an argument-rewriting graph's lock went back at launch
            graph.lock.release()
