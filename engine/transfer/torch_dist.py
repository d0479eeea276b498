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

The caller provides the process group (never a TCPStore listening on all interfaces) and maps
plan ranks to ranks *of that group* with `peers`. The group's own methods are called, so it may
be a group that `torch.distributed` does not know (a `pair_group` joining two workers) as well as
the default group (`group=None`). Only one plan may be in flight between two ranks at a time:
P2P messages are matched in order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from splitserve.engine.host_memory import huge_page_empty
from splitserve.engine.transfer import p2p_messages
from splitserve.engine.transfer.kv_tensors import check_kv_tensors
from splitserve.engine.transfer.layout import KVLayout
from splitserve.engine.transfer.p2p_messages import direct_runs, pair_chunks, run_messages
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
) -> TransferStats:
    """Send every op of `plan` read from source rank `src_rank`; `peers[dst_rank]` = its rank in `group`."""
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
    num_bytes, works, p2p = 0, [], []
    for i, dst_rank in enumerate(dst_ranks):
        direct, ops = direct_runs(plan.ops_for_pair(src_rank, dst_rank), plan.src, plan.dst, direct_bytes,
                                  kv_tensors[0].element_size())
        def staging(numel, i=i):
            return _STAGING.get(numel, dtype, device, "send-run", i)
        for message, region in run_messages(direct, plan.src, kv_tensors, "src", staging):
            if region is not None:  # a head slice: gathered here
                message.view(dtype).view(region.shape).copy_(region)
            works += _post(group, [(True, message, peers[dst_rank])])
            num_bytes += message.numel()
        buf = _STAGING.get(packed_numel(ops, plan.src), dtype, device, "send", i)
        for offset, numel, chunk_ops in pair_chunks(ops, plan.src, chunk_bytes, buf.element_size()):
            piece = pack_ops(chunk_ops, plan.src, kv_tensors, out=buf[offset:offset + numel])
            if chunk_bytes:  # gloo: on its way while the next chunk is packed
                works += _post(group, [(True, piece.view(torch.uint8), peers[dst_rank])])
            else:
                p2p.append((True, piece.view(torch.uint8), peers[dst_rank]))
        num_bytes += buf.numel() * buf.element_size()
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
) -> TransferStats:
    """Receive every op of `plan` written to destination rank `dst_rank`; `peers[src_rank]` = its rank in `group`."""
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
    num_bytes, pieces, p2p = 0, [], []
    for i, src_rank in enumerate(src_ranks):
        direct, ops = direct_runs(plan.ops_for_pair(src_rank, dst_rank), plan.src, plan.dst, direct_bytes,
                                  kv_tensors[0].element_size())
        def staging(numel, i=i):
            return _STAGING.get(numel, dtype, device, "recv-run", i)
        for message, region in run_messages(direct, plan.dst, kv_tensors, "dst", staging):
            pieces.append((message, region))  # region None: landed in place
            p2p.append((False, message, peers[src_rank]))
            num_bytes += message.numel()
        buf = _STAGING.get(packed_numel(ops, plan.dst), dtype, device, "recv", i)
        for offset, numel, chunk_ops in pair_chunks(ops, plan.dst, chunk_bytes, buf.element_size()):
            piece = buf[offset:offset + numel]
            pieces.append((piece, chunk_ops))
            p2p.append((False, piece.view(torch.uint8), peers[src_rank]))
        num_bytes += buf.numel() * buf.element_size()
    if p2p:
        works = _post(group, p2p)  # every receive posted before any wait: no order between sources to deadlock
        if chunk_bytes:  # gloo: one work per piece, in posting order; unpack each as it lands
            for work, (piece, chunk_ops) in zip(works, pieces, strict=True):
                _wait([work], f"source ranks {src_ranks}", timeout_s, device, deadline)
                _land(piece, chunk_ops, plan.dst, kv_tensors)
        else:
            _wait(works, f"source ranks {src_ranks}", timeout_s, device, deadline)
            for piece, chunk_ops in pieces:
                _land(piece, chunk_ops, plan.dst, kv_tensors)
    _sync(device)
    return TransferStats(num_bytes, time.perf_counter() - start, len(src_ranks))
