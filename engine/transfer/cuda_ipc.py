"""Same-host GPU transport over CUDA IPC: the destination maps the source's KV
tensors into its own address space once, then copies each plan op with one Triton
launch over all its layers and block runs (engine/transfer/gpu_copy.py).

Why not NIXL here: NIXL's UCX backend moves VRAM→VRAM between two processes
on one H200 with the CUDA driver's copies on UCX's streams, 12-29% of a device
copy (0.5 GB/s until cuda_ipc reads were turned on, engine/transfer/nixl_agent.py;
benchmarks/RESULTS.md), while a copy kernel over the mapped pool reaches 87-96%.
Chosen by configuration (`--transport cuda_ipc`), and by the NIXL transport itself
when source and destination share a host (`nixl_same_host.py`).

Endpoint metadata is JSON of torch's CUDA IPC handles — the fields of
`torch.multiprocessing.reductions.reduce_tensor`, with classes and dtypes by name
from a fixed allow-list, handles as hex — never a pickle: a peer's descriptor
cannot make this process run code, only fail to map (a TransferError). The
source must keep its tensors alive while peers hold mappings (it does: the KV
pool lives as long as the worker).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from splitserve.engine.transfer.gpu_copy import copy_op_cuda, current_stream
from splitserve.engine.transfer.graph_copy import PoolPairKeys, copy_op_graph, release
from splitserve.engine.transfer.graph_node import synchronize
from splitserve.engine.transfer.plan import TransferPlan
from splitserve.engine.transfer.transport import KVTransport, TransferError, TransferStats, needed_sources

_STORAGE_CLASSES = {"TypedStorage": torch.TypedStorage, "UntypedStorage": torch.UntypedStorage}
_FIELDS = ("size", "stride", "offset", "storage_cls", "dtype", "device", "handle", "storage_size",
           "storage_offset", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")


def encode_ipc_handle(rebuild, args: tuple) -> dict:
    """`reduce_tensor`'s (rebuild_cuda_tensor, 15 args) of a plain CUDA tensor -> JSON-able dict."""
    if rebuild is not rebuild_cuda_tensor or len(args) != 15:
        raise ValueError("not a CUDA tensor's IPC reduction (torch changed its format?)")
    (tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, storage_size, storage_offset,
     _requires_grad, ref_handle, ref_offset, event_handle, event_sync) = args
    if tensor_cls is not torch.Tensor or storage_cls.__name__ not in _STORAGE_CLASSES:
        raise ValueError(f"cannot encode a {tensor_cls.__name__} on {storage_cls.__name__}")
    return {
        "size": list(size), "stride": list(stride), "offset": int(offset), "storage_cls": storage_cls.__name__,
        "dtype": str(dtype).removeprefix("torch."), "device": int(device), "handle": bytes(handle).hex(),
        "storage_size": int(storage_size), "storage_offset": int(storage_offset),
        "ref_counter_handle": bytes(ref_handle).hex(), "ref_counter_offset": int(ref_offset),
        "event_handle": None if event_handle is None else bytes(event_handle).hex(),
        "event_sync_required": bool(event_sync),
    }


def decode_ipc_handle(h: dict) -> tuple:
    """The inverse of `encode_ipc_handle`: `rebuild_cuda_tensor`'s arguments, every field
    type-checked (ValueError on anything else)."""
    if not isinstance(h, dict) or sorted(h) != sorted(_FIELDS):
        raise ValueError("malformed CUDA IPC handle")
    dtype = getattr(torch, h["dtype"], None) if isinstance(h["dtype"], str) else None
    if not isinstance(dtype, torch.dtype) or h["storage_cls"] not in _STORAGE_CLASSES:
        raise ValueError(f"malformed CUDA IPC handle: dtype {h['dtype']!r}, storage {h['storage_cls']!r}")
    ints = ("offset", "device", "storage_size", "storage_offset", "ref_counter_offset")
    if not all(type(h[k]) is int for k in ints) or not all(
        isinstance(v, list) and all(type(x) is int for x in v) for v in (h["size"], h["stride"])
    ):
        raise ValueError("malformed CUDA IPC handle: sizes and offsets must be integers")
    event = None if h["event_handle"] is None else bytes.fromhex(h["event_handle"])
    return (
        torch.Tensor, torch.Size(h["size"]), tuple(h["stride"]), h["offset"], _STORAGE_CLASSES[h["storage_cls"]],
        dtype, h["device"], bytes.fromhex(h["handle"]), h["storage_size"], h["storage_offset"], False,
        bytes.fromhex(h["ref_counter_handle"]), h["ref_counter_offset"], event, bool(h["event_sync_required"]),
    )


MAX_MAPPED = 16
"""Peer pools a destination keeps mapped (a worker pulls from a handful of prefill ranks)."""


class CudaIpcTransport(KVTransport):
    kind = "cuda_ipc"

    def __init__(self, graphs: bool | None = None) -> None:
        self._mapped: dict[bytes | str, tuple[torch.Tensor, ...]] = {}
        # graph-replayed copies (engine/transfer/graph_copy.py); SPLITSERVE_GRAPH_COPY=0 turns them off
        self._graphs = os.environ.get("SPLITSERVE_GRAPH_COPY", "1") != "0" if graphs is None else graphs
        self._pool_keys = PoolPairKeys()

    def expose(self, kv_tensors: Sequence[torch.Tensor]) -> bytes:
        if not kv_tensors or not all(t.is_cuda and t.is_contiguous() for t in kv_tensors):
            raise ValueError("CUDA IPC exposes contiguous CUDA tensors only")
        return json.dumps([encode_ipc_handle(*reduce_tensor(t)) for t in kv_tensors]).encode()

    def open(self, metadata: bytes | str) -> tuple[torch.Tensor, ...]:
        """The peer's layer tensors, mapped once per metadata (`expose`'s bytes, or the same JSON
        as a str, as NIXL endpoints carry it). At most `MAX_MAPPED` peer pools stay mapped: a peer
        that suspends and resumes publishes new handles, and torch keeps the old pool's memory
        allocated on the peer for as long as a mapping of it lives here. A tuple: it cannot change,
        so the pool-pair memo trusts its identity (graph_copy.PoolPairKeys)."""
        # bytes and str objects cache their hash: a repeated lookup of the same object is O(1)
        key = metadata if isinstance(metadata, (bytes, str)) else bytes(metadata)
        tensors = self._mapped.get(key)
        if tensors is None:
            try:
                tensors = tuple(rebuild_cuda_tensor(*decode_ipc_handle(h)) for h in json.loads(metadata))
            except Exception as exc:
                raise TransferError(f"cannot map the peer's KV over CUDA IPC: {exc}") from exc
            if len(self._mapped) >= MAX_MAPPED:  # the oldest goes, with the pair memos holding it
                del self._mapped[next(iter(self._mapped))]
                self._pool_keys.clear()
            self._mapped[key] = tensors
        return tensors

    def pull(
        self,
        plan: TransferPlan,
        dst_rank: int,
        remote: Mapping[int, bytes | str],
        kv_tensors: Sequence[torch.Tensor],
        timeout_s: float = 30.0,
    ) -> TransferStats:
        start = time.perf_counter()
        mapped = {src_rank: self.open(remote[src_rank]) for src_rank in needed_sources(plan, dst_rank, remote)}
        return self.pull_mapped(plan, dst_rank, mapped, kv_tensors, start)

    def pull_mapped(
        self,
        plan: TransferPlan,
        dst_rank: int,
        mapped: Mapping[int, tuple[torch.Tensor, ...]],
        kv_tensors: Sequence[torch.Tensor],
        start: float,
    ) -> TransferStats:
        """`pull` from pools `open` has mapped already (`mapped`: every source rank the plan reads
        for `dst_rank`), timed from `start` (a `time.perf_counter()`): NIXL's same-host path
        (nixl_same_host.py) maps before it decides, and would otherwise look everything up twice."""
        stream = current_stream(kv_tensors[0].get_device())
        num_bytes = num_ops = 0
        held: list = []  # graphs replayed by this pull: theirs until the copies have run
        try:
            for src_rank, src in mapped.items():
                pools = self._pool_keys.key(src, kv_tensors) if self._graphs else None
                ops = plan.ops_for_pair(src_rank, dst_rank)
                for op in ops:
                    # one launch for every layer and block run of the op; replayed from a graph when it can
                    if not (self._graphs and copy_op_graph(op, src, kv_tensors, held, pools, stream)):
                        copy_op_cuda(op, src, kv_tensors)
                num_bytes += plan.pair_bytes(src_rank, dst_rank)
                num_ops += len(ops)
        finally:
            synchronize(stream)  # the copies ran on it; no device-wide sync
            release(held)
        return TransferStats(num_bytes, time.perf_counter() - start, num_ops)

    def close(self) -> None:
        self._mapped.clear()
        self._pool_keys.clear()
