"""Same-host CPU transport over shared memory: the CPU analogue of `cuda_ipc`.

    source rank                                     destination rank
    expose(kv): each layer's storage moves into     pull: open /proc/<pid>/fd/<fd> once per
      shared memory (in place: every view keeps       source, map it, then one strided torch
      working) and its fd is published                copy per (op, layer, block run) straight
                                                      into the destination pool

Why not NIXL here: on one host NIXL/UCX moves DRAM at 27-50% of a memcpy (UCX shared-memory
transports bounce through a second copy, CMA pays per region), and a reshard's strided head
slices cost one UCX request each (~65k for a 32k-token prompt). A mapped pool turns the
whole handoff into one copy pass at memory speed, whatever the layouts (benchmarks/RESULTS.md).
NIXL stays the transport across hosts.

Endpoint metadata is JSON (pid, per-layer fd / size / shape / stride), only meaningful on the
same host to a process of the same user. The source must keep its tensors alive while peers
hold mappings (it does: the KV pool lives as long as the worker); a remapped pool (lifecycle
suspend + resume) is exposed again and publishes new fds, so stale mappings are never reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping, Sequence

import torch

from splitserve.engine.transfer.kv_tensors import check_kv_tensors
from splitserve.engine.transfer.local_copy import copy_op
from splitserve.engine.transfer.plan import TransferPlan
from splitserve.engine.transfer.progress import NUM_BOARD_SLOTS, ProgressBoard
from splitserve.engine.transfer.transport import KVTransport, TransferError, TransferStats, needed_sources

_MAGIC = b"SSHM1"


def share_tensor(t: torch.Tensor) -> dict:
    """Move `t`'s storage into shared memory (in place) and describe how a peer maps it."""
    if t.is_cuda or not t.is_contiguous():
        raise ValueError("the shm transport shares contiguous CPU tensors only (use cuda_ipc on GPUs)")
    fd, size = t.untyped_storage()._share_fd_cpu_()
    return {"fd": fd, "size": size, "offset": t.storage_offset(), "shape": list(t.shape),
            "stride": list(t.stride()), "dtype": str(t.dtype).removeprefix("torch.")}


def map_tensor(pid: int, entry: dict) -> torch.Tensor:
    """Map a tensor `share_tensor` described in process `pid` (a view of the same memory)."""
    fd = os.open(f"/proc/{int(pid)}/fd/{int(entry['fd'])}", os.O_RDWR)
    try:
        # Never map past the end of the file: reading there would kill this process (SIGBUS).
        if not 0 < int(entry["size"]) <= os.fstat(fd).st_size:
            raise ValueError(f"shared region of {entry['size']!r} bytes, the file holds {os.fstat(fd).st_size}")
        storage = torch.UntypedStorage._new_shared_fd_cpu(fd, int(entry["size"]))
    finally:
        os.close(fd)
    dtype = getattr(torch, entry["dtype"])
    return torch.empty(0, dtype=dtype).set_(storage, entry["offset"], entry["shape"], entry["stride"])


class ShmTransport(KVTransport):
    """One worker rank's end: shares its pool (and progress board) on `expose`, maps peers' on `pull`."""

    kind = "shm"

    def __init__(self, num_board_slots: int = NUM_BOARD_SLOTS) -> None:
        self._num_board_slots = num_board_slots
        self._mapped: dict[bytes, tuple[list[torch.Tensor], torch.Tensor | None]] = {}

    def expose(self, kv_tensors: Sequence[torch.Tensor]) -> bytes:
        if not kv_tensors:
            raise ValueError("expose needs a non-empty list of contiguous KV tensors")
        layers = [share_tensor(t) for t in kv_tensors]
        if self.board is None or self.board.shape != ProgressBoard.for_pool(kv_tensors, self._num_board_slots).shape:
            self.board = ProgressBoard.for_pool(kv_tensors, self._num_board_slots)
        info = {"pid": os.getpid(), "layers": layers, "board": share_tensor(self.board.tensor)}
        return _MAGIC + json.dumps(info).encode()

    def open(self, metadata: bytes) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The peer's tensors and board, mapped once per endpoint and cached."""
        key = hashlib.sha256(metadata).digest()
        mapped = self._mapped.get(key)
        if mapped is None:
            if not metadata.startswith(_MAGIC):
                raise TransferError(f"not shm endpoint metadata (starts {metadata[:8]!r})")
            try:
                info = json.loads(metadata[len(_MAGIC):])
                board = map_tensor(info["pid"], info["board"]) if info.get("board") else None
                mapped = ([map_tensor(info["pid"], entry) for entry in info["layers"]], board)
            except (OSError, ValueError, KeyError, RuntimeError) as exc:
                raise TransferError(f"cannot map the peer's KV pool (is it on this host?): {exc}") from exc
            self._mapped[key] = mapped
        return mapped

    def pull(
        self,
        plan: TransferPlan,
        dst_rank: int,
        remote: Mapping[int, bytes],
        kv_tensors: Sequence[torch.Tensor],
        timeout_s: float = 30.0,
    ) -> TransferStats:
        start = time.perf_counter()
        check_kv_tensors(kv_tensors, plan.dst, dst_rank)
        num_bytes = num_ops = 0
        for src_rank in needed_sources(plan, dst_rank, remote):
            src, _ = self.open(remote[src_rank])
            check_kv_tensors(src, plan.src, src_rank)
            for op in plan.ops_for_pair(src_rank, dst_rank):
                copy_op(op, src, kv_tensors)
                num_bytes += plan.op_bytes(op)
                num_ops += 1
        return TransferStats(num_bytes, time.perf_counter() - start, num_ops)

    def read_board(self, metadata: bytes, slot: int, width: int) -> list[int]:
        _, board = self.open(metadata)
        if board is None or board.shape[1] != width or not 0 <= slot < board.shape[0]:
            shape = None if board is None else tuple(board.shape)
            raise TransferError(f"progress board {shape} has no slot {slot} of width {width}")
        return board[slot].tolist()  # shared memory: a plain read, front to back

    def unexpose(self) -> None:
        """Nothing to deregister: the shared storage stays valid while the pool lives."""

    def close(self) -> None:
        self._mapped.clear()
