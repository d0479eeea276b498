"""Two-sided KV transfer over torch.distributed point-to-point (NCCL on GPU, gloo on CPU).

P2P needs both ends, so each source rank calls `send_plan` and each destination rank calls
`recv_plan` with the same plan (`build_plan` is deterministic: both sides can build it from the
handoff descriptor). Per (src, dst) pair the regions travel as one packed buffer (`pack.py`)::

    src rank s: pack(ops s→d) ──isend──▶ dst rank d: irecv ──▶ unpack(ops s→d)

All sends (receives) of a rank are posted together (on CUDA inside one NCCL group call), so no
ordering between pairs can deadlock. On the CPU (gloo) a pair travels as several messages
instead, cut from the plan by `p2p_messages.py` (layer-cut chunks of the packed buffer, and
block runs read and written in place), so packing, TCP and unpacking overlap and most of the
staging copies go.

Layer-wise push: given `layer_ready`, `send_plan` sends layer after layer of its source rank, each
once `layer_ready(layer, seconds_left)` returns (the prefill has written it), while the
destination, calling `recv_plan(..., by_layer=True)`, has every receive posted already — so the
transfer runs under the prefill's compute and only the last layer is left when it ends. Both
sides then cut the same per-layer messages (`p2p_messages.layer_groups`); on CUDA each layer is
one NCCL group call on both sides.

The caller provides the process group (never a TCPStore listening on all interfaces) and maps
plan ranks to ranks *of that group* with `peers`. The group's own methods are called, so it may
be a group that `torch.distributed` does not know (a `pair_group` joining two workers) as well as
the default group (`group=None`). Only one plan may be in flight between two ranks at a time:
P2P messages are matched in order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from splitserve.engine.host_memory import huge_page_empty
from splitserve.engine.transfer import p2p_messages
from splitserve.engine.transfer.kv_tensors import check_kv_tensors
from splitserve.engine.transfer.layout import KVLayout
from splitserve.engine.transfer.p2p_messages import direct_runs, layer_groups, pair_chunks, run_messages
from splitserve.engine.transfer.pack import pack_ops, packed_numel, unpack_ops
from splitserve.engine.transfer.plan import TransferPlan
from splitserve.engine.transfer.transport import TransferError, TransferStats, TransferTimeout

_TAG = 0

class _Staging(threading.local):
    """Pack buffers kept between transfers, per thread: a fresh 1 GB buffer per transfer cost
    more in first-touch page faults than the copy itself (a 32k-token handoff moved at 0.6 GB/s
    over gloo; CPU buffers also ask for huge pages, engine/host_memory.py). Each grows to the
    largest transfer seen, one per (device, send|recv, peer slot)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, str, int], torch.Tensor] = {}

    def get(self, numel: int, dtype: torch.dtype, device: torch.device, role: str, slot: int) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        key = (str(device), role, slot)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < nbytes:
            self.buffers.pop(key, None)  # freed before its successor is allocated
            buf = self.buffers[key] = (huge_page_empty(nbytes, torch.uint8) if device.type == "cpu"
                                       else torch.empty(nbytes, dtype=torch.uint8, device=device))
        return buf[:nbytes].view(dtype)


_STAGING = _Staging()


def _post(group: dist.ProcessGroup | None, ops: list[tuple[bool, torch.Tensor, int]]) -> list:
    """Post (is_send, buffer, group peer) operations together; return the works to wait on."""
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise ValueError("no process group: pass one or initialise the default group")
    device = ops[0][1].device
    # A ProcessGroup dispatches to its backend per device; a bare Backend (ProcessGroupGloo, ...) is its own.
    backend = pg._get_backend(device) if isinstance(pg, dist.ProcessGroup) else pg
    coalesce = device.type == "cuda" and backend.supports_coalescing
    if coalesce:  # NCCL: one ncclGroupStart/End over every peer
        pg._start_coalescing(device)
    works = [pg.send([buf], peer, _TAG) if is_send else pg.recv([buf], peer, _TAG) for is_send, buf, peer in ops]
    if coalesce:
        works = [pg._end_coalescing(device)]
    return [w for w in works if w is not None]


def _wait(works: list, peers_desc: str, timeout_s: float, device: torch.device, deadline: float | None = None) -> None:
    """Wait for `works` until `deadline` (a `time.monotonic()`; default `timeout_s` from now),
    naming `timeout_s` in the error."""
    if deadline is None:
        deadline = time.monotonic() + timeout_s
    if device.type == "cuda":  # NCCL works complete asynchronously: poll, never block without a deadline
        while not all(w.is_completed() for w in works):
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"torch.distributed transfer with {peers_desc} timed out after {timeout_s:.1f}s")
            time.sleep(0.0002)
        for w in works:
            w.wait()
        return
    for work in works:
        left = max(0.001, deadline - time.monotonic())
        try:
            ok = work.wait(timeout=timedelta(seconds=left))
        except RuntimeError as exc:  # gloo reports a timeout (or a dead peer) by raising
            text = str(exc).lower()
            if "timed out" in text or "timeout" in text or time.monotonic() >= deadline:
                raise TransferTimeout(f"torch.distributed transfer with {peers_desc} timed out after "
                                      f"{timeout_s:.1f}s: {exc}") from exc
            raise TransferError(f"torch.distributed transfer with {peers_desc} failed: {exc}") from exc
        if ok is False:
            raise TransferTimeout(f"torch.distributed transfer with {peers_desc} timed out after {timeout_s:.1f}s")


def _land(piece: torch.Tensor, what, layout: KVLayout, kv_tensors: Sequence[torch.Tensor]) -> None:
    """Put a received piece in place: `what` is a packed chunk's ops, a direct run's pool region
    (staged: a head slice), or None (it landed in place)."""
    if isinstance(what, torch.Tensor):
        what.copy_(piece.view(what.dtype).view(what.shape))
    elif what is not None:
        unpack_ops(piece, what, layout, kv_tensors)


class _Carve:
    """Consecutive slices of one staging buffer: every staged message of a pair has its own
    (sends and receives are in flight together). Sized for the whole pair packed, an upper bound;
    CPU pages never written are never mapped."""

    def __init__(self, buf: torch.Tensor):
        self.buf, self.used = buf, 0

    def take(self, numel: int) -> torch.Tensor:
        piece = self.buf[self.used:self.used + numel]
        self.used += numel
        return piece


def _schedule(pairs: Sequence[int], ops_of, by_layer: bool):
    """(source layer, pair index, ops) in sending order: pair after pair, or (`by_layer`) layer after
    layer, pairs in order within a layer. Each pair sees its own groups in the same order either way."""
    items = [(layer, i, ops) for i, other in enumerate(pairs) for layer, ops in layer_groups(ops_of(other), by_layer)]
    return sorted(items, key=lambda item: (item[0], item[1])) if by_layer else items


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def send_plan(
    plan: TransferPlan,
    src_rank: int,
    kv_tensors: Sequence[torch.Tensor],
    peers: Mapping[int, int],
    group: dist.ProcessGroup | None = None,
    timeout_s: float = 30.0,
    layer_ready: Callable[[int, float], None] | None = None,
) -> TransferStats:
    """Send every op of `plan` read from source rank `src_rank`; `peers[dst_rank]` = its rank in `group`.

    `layer_ready(layer, seconds_left)`: a layer-wise push (the destination calls `recv_plan` with
    `by_layer=True`): it is called before each source local layer's messages and returns once this
    rank has written that layer, or raises (TransferTimeout when `seconds_left` runs out)."""
    start = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    check_kv_tensors(kv_tensors, plan.src, src_rank)
    dst_ranks = sorted({op.dst_rank for op in plan.ops_for_src(src_rank)})
    missing = [d for d in dst_ranks if d not in peers]
    if missing:
        raise ValueError(f"no torch.distributed rank for destination ranks {missing} (peers {dict(peers)})")
    device, dtype = kv_tensors[0].device, kv_tensors[0].dtype
    chunk_bytes = p2p_messages.CHUNK_BYTES if device.type == "cpu" else 0
    direct_bytes = p2p_messages.DIRECT_BYTES if device.type == "cpu" else 0
    by_layer, eager = layer_ready is not None, device.type == "cpu"  # gloo: each message posted once ready
    carves = [_Carve(_STAGING.get(packed_numel(plan.ops_for_pair(src_rank, d), plan.src), dtype, device, "send", i))
              for i, d in enumerate(dst_ranks)]
    num_bytes, works, p2p, current = 0, [], [], None
    for layer, i, ops in _schedule(dst_ranks, lambda d: plan.ops_for_pair(src_rank, d), by_layer):
        peer = peers[dst_ranks[i]]
        if by_layer and layer != current:
            if p2p:  # CUDA: the previous layer's one group call
                works += _post(group, p2p)
                p2p = []
            layer_ready(layer, max(0.0, deadline - time.monotonic()))
            current = layer
        direct, packed = direct_runs(ops, plan.src, plan.dst, direct_bytes, kv_tensors[0].element_size())
        sends = []
        for message, region in run_messages(direct, plan.src, kv_tensors, "src", carves[i].take):
            if region is not None:  # a head slice: gathered here
                message.view(dtype).view(region.shape).copy_(region)
            sends.append(message)
            if eager:
                works += _post(group, [(True, message, peer)])
        buf = carves[i].take(packed_numel(packed, plan.src))
        for offset, numel, chunk_ops in pair_chunks(packed, plan.src, chunk_bytes, buf.element_size()):
            sends.append(pack_ops(chunk_ops, plan.src, kv_tensors, out=buf[offset:offset + numel]).view(torch.uint8))
            if eager:  # gloo: on its way while the next chunk is packed
                works += _post(group, [(True, sends[-1], peer)])
        if not eager:
            p2p += [(True, m, peer) for m in sends]
        num_bytes += sum(m.numel() for m in sends)
    if p2p:
        works += _post(group, p2p)
    if works:
        _wait(works, f"destination ranks {dst_ranks}", timeout_s, device, deadline)
        _sync(device)
    return TransferStats(num_bytes, time.perf_counter() - start, len(dst_ranks))


def recv_plan(
    plan: TransferPlan,
    dst_rank: int,
    kv_tensors: Sequence[torch.Tensor],
    peers: Mapping[int, int],
    group: dist.ProcessGroup | None = None,
    timeout_s: float = 30.0,
    by_layer: bool = False,
) -> TransferStats:
    """Receive every op of `plan` written to destination rank `dst_rank`; `peers[src_rank]` = its rank in `group`.
    `by_layer`: the sources push layer-wise (`send_plan(..., layer_ready=...)`)."""
    start = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    check_kv_tensors(kv_tensors, plan.dst, dst_rank)
    src_ranks = sorted({op.src_rank for op in plan.ops_for_dst(dst_rank)})
    missing = [s for s in src_ranks if s not in peers]
    if missing:
        raise ValueError(f"no torch.distributed rank for source ranks {missing} (peers {dict(peers)})")
    device, dtype = kv_tensors[0].device, kv_tensors[0].dtype
    chunk_bytes = p2p_messages.CHUNK_BYTES if device.type == "cpu" else 0
    direct_bytes = p2p_messages.DIRECT_BYTES if device.type == "cpu" else 0
    carves = [_Carve(_STAGING.get(packed_numel(plan.ops_for_pair(s, dst_rank), plan.dst), dtype, device, "recv", i))
              for i, s in enumerate(src_ranks)]
    pieces, works, p2p, current = [], [], [], None
    for layer, i, ops in _schedule(src_ranks, lambda s: plan.ops_for_pair(s, dst_rank), by_layer):
        peer = peers[src_ranks[i]]
        if by_layer and layer != current:
            if p2p and device.type == "cuda":  # a group call per layer, as sent
                works += _post(group, p2p)
                p2p = []
            current = layer
        direct, packed = direct_runs(ops, plan.src, plan.dst, direct_bytes, kv_tensors[0].element_size())
        for message, region in run_messages(direct, plan.dst, kv_tensors, "dst", carves[i].take):
            pieces.append((message, region))  # region None: landed in place
            p2p.append((False, message, peer))
        buf = carves[i].take(packed_numel(packed, plan.dst))
        for offset, numel, chunk_ops in pair_chunks(packed, plan.dst, chunk_bytes, buf.element_size()):
            piece = buf[offset:offset + numel]
            pieces.append((piece, chunk_ops))
            p2p.append((False, piece.view(torch.uint8), peer))
    if p2p:
        works += _post(group, p2p)  # every receive posted before any wait: no order between sources to deadlock
    num_bytes = sum(piece.numel() * piece.element_size() for piece, _ in pieces)
    if works and device.type == "cpu":  # gloo: one work per piece, in posting order; unpack each as it lands
        for work, (piece, chunk_ops) in zip(works, pieces, strict=True):
            _wait([work], f"source ranks {src_ranks}", timeout_s, device, deadline)
            _land(piece, chunk_ops, plan.dst, kv_tensors)
    elif works:
        _wait(works, f"source ranks {src_ranks}", timeout_s, device, deadline)
        for piece, chunk_ops in pieces:
            _land(piece, chunk_ops, plan.dst, kv_tensors)
    _sync(device)
    return TransferStats(num_bytes, time.perf_counter() - start, len(src_ranks))
