"""Same-process transport: for unit tests and for the aggregated fallback (prefill == decode process).

It behaves like a memory transport: `expose` registers the tensors under a token (the endpoint
metadata), and `pull` copies the plan's byte regions (`regions.py`) one by one, exactly the
descriptors a NIXL pull would post, so tests exercise the same address arithmetic.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Mapping, Sequence

import torch

from splitserve.engine.transfer.kv_tensors import check_kv_tensors
from splitserve.engine.transfer.plan import TransferPlan
from splitserve.engine.transfer.progress import NUM_BOARD_SLOTS, ProgressBoard
from splitserve.engine.transfer.regions import ops_regions
from splitserve.engine.transfer.transport import KVTransport, TransferError, TransferStats, needed_sources

_PREFIX = b"inproc:"
_registry: dict[bytes, list[torch.Tensor]] = {}
_boards: dict[bytes, torch.Tensor] = {}
_lock = threading.Lock()
_counter = itertools.count()


def _own_prefix() -> bytes:
    return _PREFIX + f"{os.getpid()}:".encode()


def exposed(token: bytes, what: str = "endpoint") -> list[torch.Tensor]:
    """The tensors exposed under `token` in this process. TransferError, at once, for a token of
    another process — the in-process transport reaches no other process (tokens name their
    process: a bare counter made a peer's token name this process's own pool) — or one closed."""
    if not token.startswith(_own_prefix()):
        raise TransferError(f"{what} {token!r} was exposed by another process; the in-process transport "
                            "reaches only its own process: workers in processes of their own need "
                            "--transport nixl, shm, cuda_ipc or torch_dist")
    with _lock:
        tensors = _registry.get(token)
    if tensors is None:
        raise TransferError(f"{what} {token!r} is not exposed")
    return tensors


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


class InProcTransport(KVTransport):
    """Registers tensors in a process-wide table; pulls by copying byte regions."""

    kind = "inproc"

    def __init__(self, num_board_slots: int = NUM_BOARD_SLOTS) -> None:
        self._tokens: list[bytes] = []
        self._num_board_slots = num_board_slots

    def expose(self, kv_tensors: Sequence[torch.Tensor]) -> bytes:
        if not kv_tensors or not all(t.is_contiguous() for t in kv_tensors):
            raise ValueError("expose needs a non-empty list of contiguous KV tensors")
        token = _own_prefix() + str(next(_counter)).encode()
        board = ProgressBoard.for_pool(kv_tensors, self._num_board_slots)
        if self.board is None or self.board.shape != board.shape:  # exposed again: keep live slots
            self.board = board
        with _lock:
            _registry[token] = list(kv_tensors)
            _boards[token] = self.board.tensor
        self._tokens.append(token)
        return token

    def pull(
        self,
        plan: TransferPlan,
        dst_rank: int,
        remote: Mapping[int, bytes],
        kv_tensors: Sequence[torch.Tensor],
        timeout_s: float = 30.0,
    ) -> TransferStats:
        start = time.perf_counter()
        dst_pool = check_kv_tensors(kv_tensors, plan.dst, dst_rank)
        dst_bytes = [_byte_view(t) for t in kv_tensors]
        num_bytes = num_regions = 0
        for src_rank in needed_sources(plan, dst_rank, remote):
            src_tensors = exposed(remote[src_rank], f"source rank {src_rank}: endpoint")
            src_pool = check_kv_tensors(src_tensors, plan.src, src_rank)
            src_bytes = [_byte_view(t) for t in src_tensors]
            regions = ops_regions(plan.ops_for_pair(src_rank, dst_rank), plan.src, plan.dst, src_pool, dst_pool)
            for sl, so, dl, do, n in zip(
                regions.src_layer.tolist(), regions.src_offset.tolist(), regions.dst_layer.tolist(),
                regions.dst_offset.tolist(), regions.num_bytes.tolist(), strict=True,
            ):
                dst_bytes[dl][do:do + n].copy_(src_bytes[sl][so:so + n])
            num_bytes += regions.bytes_total
            num_regions += len(regions)
        return TransferStats(num_bytes, time.perf_counter() - start, num_regions)

    def read_board(self, metadata: bytes, slot: int, width: int) -> list[int]:
        exposed(metadata)
        with _lock:
            board = _boards.get(metadata)
        if board is None or board.shape[1] != width or not 0 <= slot < board.shape[0]:
            raise TransferError(f"endpoint {metadata!r} has no progress board slot {slot} of width {width}")
        return board[slot].tolist()

    def close(self) -> None:
        with _lock:
            for token in self._tokens:
                _registry.pop(token, None)
                _boards.pop(token, None)
        self._tokens.clear()
