"""Layer-wise streamed pull: read each layer's KV as soon as the prefill side has written it.

    prefill rank (source)                         decode rank (destination)
    layer 0 computed -> board: units, ready[0]    poll the boards of its sources ──┐
    layer 1 computed -> board: units, ready[1]    layers ready on every source it  │ one pull
    ...                                             reads them from → sub-plan ─────┘ per poll
    layer L-1 computed -> prefill ends            verify each pulled (layer, head) unit
                                                  against the board → only the last layers'
                                                  pull is left once prefill ends (exposed time)

The plan is the ordinary `TransferPlan`; a poll that finds new layers cuts its ops down to
those layers (`layer_slice`) and hands the sub-plan to the transport's normal `pull`, so every
pull transport with a board (made in `expose`, read by `read_board`) streams, with its own coalescing.
Unit checksums on the board are over all the request's blocks, so they are checked when the
whole request is pulled (`first_block == 0`); a prefix-hit import is verified by the
descriptor's block checksums afterwards instead, as a non-streamed import is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from splitserve.engine.transfer.plan import TransferOp, TransferPlan, layer_slice
from splitserve.engine.transfer.progress import BoardShape, RowView, layer_unit_checksums
from splitserve.engine.transfer.transport import (
    KVTransport,
    TransferError,
    TransferStats,
    TransferTimeout,
    needed_sources,
)


class UnitChecksumError(TransferError):
    """A streamed layer does not match the unit checksums the source published with it."""


@dataclass(frozen=True)
class StreamSpec:
    """Which board row holds a streamed handoff's readiness (from the descriptor); every
    source rank uses the same slot, and the boards are found through the endpoints."""

    slot: int
    tag: int
    """`progress.request_tag(request_id)`."""
    num_tokens: int


def board_shape(plan: TransferPlan, src_rank: int) -> BoardShape:
    """The row geometry of a source rank's board (its slot count does not matter to a reader)."""
    lay = plan.src
    return BoardShape(1, lay.num_local_layers(lay.pp_rank(src_rank)), lay.num_local_heads)


def streamed_pull(
    transport: KVTransport,
    plan: TransferPlan,
    dst_rank: int,
    remote: Mapping[int, bytes],
    kv_tensors: Sequence[torch.Tensor],
    stream: StreamSpec,
    timeout_s: float = 30.0,
    poll_s: float = 0.0002,
    max_poll_s: float | None = None,
    verify: bool = True,
    cancel: threading.Event | None = None,
    on_layers: Callable[[list[int]], None] | None = None,
    stall_timeout_s: float | None = None,
) -> TransferStats:
    """Pull `dst_rank`'s ops of `plan` layer by layer as the sources' boards show them ready.

    Blocks until every layer is in (and verified against its units when `verify` and the whole
    request is pulled); raises TransferTimeout naming the layers still missing at the deadline
    (`timeout_s` in all, or `stall_timeout_s` without a new layer, whichever comes first),
    UnitChecksumError for a layer that arrived wrong, TransferError once `cancel` is set (checked
    between pulls). A poll that finds nothing new doubles the wait before the next, up to
    `max_poll_s` (default `poll_s`: no backoff); progress resets it. `on_layers(layers)` is told the destination (local) layers every op of this
    rank has now delivered, as they complete (a prefetch checksums them meanwhile).
    """
    start = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    stalled_at = time.monotonic() + (stall_timeout_s if stall_timeout_s is not None else timeout_s)
    ops = plan.ops_for_dst(dst_rank)
    sources = needed_sources(plan, dst_rank, remote)
    shapes = {s: board_shape(plan, s) for s in sources}
    pulled = [0] * len(ops)
    num_bytes = num_regions = 0
    check = verify and plan.first_block == 0
    reported: set[int] = set()
    wait_s = poll_s
    while any(done < op.num_layers for done, op in zip(pulled, ops, strict=True)):
        if cancel is not None and cancel.is_set():
            raise TransferError("layer-wise pull cancelled")
        rows = {s: RowView.parse(transport.read_board(remote[s], stream.slot, shapes[s].width), shapes[s])
                for s in sources}
        ready = {s: row.num_ready_layers(stream.tag, stream.num_tokens) for s, row in rows.items()}
        batch: list[TransferOp] = []
        for i, op in enumerate(ops):
            upto = min(op.num_layers, ready[op.src_rank] - op.src_layer_start)
            if upto > pulled[i]:
                batch.append(layer_slice(op, pulled[i], upto))
                pulled[i] = upto
        if not batch:
            if time.monotonic() > min(deadline, stalled_at):
                waiting = sorted({op.layer_start + done for done, op in zip(pulled, ops, strict=True)
                                  if done < op.num_layers})
                raise TransferTimeout(f"layer-wise pull: layers from {waiting} not ready in time "
                                      f"({timeout_s:.1f}s in all, {stall_timeout_s}s without progress)")
            time.sleep(wait_s)
            wait_s = min(2 * wait_s, max_poll_s or poll_s)
            continue
        wait_s = poll_s
        if stall_timeout_s is not None:
            stalled_at = time.monotonic() + stall_timeout_s
        stats = transport.pull(replace(plan, ops=tuple(batch)), dst_rank, remote, kv_tensors,
                               max(0.001, min(deadline, stalled_at) - time.monotonic()))
        num_bytes += stats.num_bytes
        num_regions += stats.num_regions
        if check:
            def reread(src_rank: int) -> RowView:
                row = transport.read_board(remote[src_rank], stream.slot, shapes[src_rank].width)
                return RowView.parse(row, shapes[src_rank])

            _verify(batch, rows, kv_tensors, reread)
        if on_layers is not None:
            done = _complete_layers(ops, pulled) - reported
            reported |= done
            if done:
                on_layers(sorted(done))
    return TransferStats(num_bytes, time.perf_counter() - start, num_regions)


def _complete_layers(ops: Sequence[TransferOp], pulled: Sequence[int]) -> set[int]:
    """Destination layers that every op writing them has delivered (`pulled[i]` layers of op i)."""
    need: dict[int, int] = {}
    have: dict[int, int] = {}
    for done, op in zip(pulled, ops, strict=True):
        for j in range(op.num_layers):
            layer = op.dst_layer_start + j
            need[layer] = need.get(layer, 0) + 1
            have[layer] = have.get(layer, 0) + (j < done)
    return {layer for layer, n in need.items() if have[layer] == n}


def _verify(batch: Sequence[TransferOp], rows: Mapping[int, RowView], kv_tensors: Sequence[torch.Tensor],
            reread) -> None:
    """Check each pulled (layer, head) against its unit. A mismatch is checked once more against a
    fresh read of the row: a one-sided read (RDMA) need not copy the row front to back, so the
    first read may have caught a layer's `ready` before its units."""
    for op in batch:
        heads = range(op.dst_head_start, op.dst_head_start + op.num_heads)
        blocks = op.dst_blocks()
        for i in range(op.num_layers):
            got = layer_unit_checksums(kv_tensors[op.dst_layer_start + i], blocks, heads).tolist()
            sl = slice(op.src_head_start, op.src_head_start + op.num_heads)
            if got != list(rows[op.src_rank].units[op.src_layer_start + i][sl]) and \
                    got != list(reread(op.src_rank).units[op.src_layer_start + i][sl]):
                raise UnitChecksumError(
                    f"layer-wise pull: layer {op.layer_start + i} heads from source rank {op.src_rank} "
                    f"(local {op.src_head_start}..{op.src_head_start + op.num_heads - 1}) do not match their checksums")
