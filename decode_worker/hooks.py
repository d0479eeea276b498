"""Decode role, on every rank: the "import" command pulls a handoff's KV into
freshly allocated blocks (a collective: every rank pulls its part of the
plan, then the group votes and verifies checksums) and admits the request.
With torch_dist the transfer step instead asks the prefill worker to push
(rank 0, through `DecodeState.ask_push`) and every rank receives its part.
Hybrid models move the recurrent state with the KV (`make_importer`; torch_dist: a second push,
engine/handoff_push_state.py). Rank 0 forwards each step's outputs to the streams waiting for them.
With layer-wise streaming (`--layerwise`, a pull transport), the "prefetch" command starts pulling a
handoff prefill is still computing (engine/prefetch.py) and "import" uses what it pulled."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.engine.engine import Engine, StepOutput
from splitserve.engine.handoff import (
    ChecksumMismatchError,
    HandoffDescriptor,
    RankEndpoint,
    TransferStep,
    engine_layout,
    make_importer,
    pull_step,
)
from splitserve.engine.handoff_push import (
    PushGrant,
    PushRefusedError,
    PushRequest,
    TorchDistEndpoint,
    TorchDistTransport,
)
from splitserve.engine.prefetch import Prefetches, SerializedTransport
from splitserve.engine.serving import Command
from splitserve.engine.state_handoff import StateStep, has_recurrent_state
from splitserve.engine.transfer.layout import layout_text
from splitserve.engine.transfer.transport import KVTransport, TransferError, TransferStats, TransportEndpoint

log = logging.getLogger(__name__)


ABORTED_REMEMBERED = 4096
"""Request ids of recent Aborts a decode worker remembers (`RecentIds`)."""


class RecentIds:
    """The last `limit` ids added, oldest forgotten first. The router sends a request's Prefetch
    from a background task and its Abort (client gone) as another call: the Abort can reach the
    worker first, and a Prefetch applied after it would hold its reserved blocks until the lease
    ran out. An aborted id's Prefetch is declined instead (a Decode, if one still came, pulls)."""

    def __init__(self, limit: int) -> None:
        self._ids: dict[str, None] = {}
        self._limit = limit

    def add(self, request_id: str) -> None:
        self._ids.pop(request_id, None)
        self._ids[request_id] = None
        if len(self._ids) > self._limit:
            del self._ids[next(iter(self._ids))]

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids


@dataclass(frozen=True)
class ImportOutcome:
    num_reused_blocks: int
    stats: TransferStats | None
    started: float = 0.0
    """`time.monotonic()` when the import command began on the engine thread (queue wait ends)."""
    finished: float = 0.0
    dst_layout: str = ""
    """The decode side's KV layout (engine/transfer/layout.py `layout_text`)."""
    prefetched: bool = False
    """The KV came from a layer-wise prefetch (engine/prefetch.py) started during prefill."""


@dataclass
class DecodeState:
    """Rank 0: the asyncio queue of every open Decode stream."""

    streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = field(default_factory=dict)
    accepts_prefetch: bool = False
    """Layer-wise streaming is on with a pull transport: Prefetch calls are taken up."""
    ask_push: Callable[[str, PushRequest], PushGrant] | None = None
    """torch_dist: `ask_push(prefill_address, request)` calls PushKV (set by the service;
    called from the engine thread, blocking, within the request's deadline)."""

    def deliver(self, outputs: list[StepOutput]) -> None:
        """Hand a step's outputs to their streams: one `call_soon_threadsafe` per event loop
        a step, not one per output — each wakes the loop through its self-pipe and, on a
        busy host, costs the engine thread ~3 µs (64 outputs: ~0.2 ms a step, against ~10 µs
        batched on this 2-core machine; benchmarks/RESULTS.md, session 21)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, StepOutput]]] = {}
        for out in outputs:
            entry = self.streams.get(out.request_id)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append((entry[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop closed (its streams are gone): the other loops still get theirs
                log.debug("dropped %d outputs for a closed event loop", len(items))


def _put_all(items: list[tuple[asyncio.Queue, StepOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)


def decode_hooks(engine: Engine, transport: TransportEndpoint, endpoints: dict[int, RankEndpoint] | None) -> dict:
    # The streams read each step's additions from the outputs; whole-result snapshots of every
    # running request every step cost O(tokens) each (~0.2 ms a step at batch 64, ~1 ms at 4k
    # tokens generated: as long as a batch-64 GPU step; benchmarks/RESULTS.md, session 21).
    engine.snapshot_outputs = False
    state = DecodeState() if endpoints is not None else None
    if isinstance(transport, TorchDistTransport) and endpoints is not None:
        transport.group_endpoints = [TorchDistEndpoint.from_bytes(e.agent_metadata) for e in endpoints.values()]

    pull = transport if isinstance(transport, KVTransport) else None
    prefetches = None
    if (pull is not None and engine.config.transfer.layerwise and not getattr(engine, "is_simulated", False)
            and not has_recurrent_state(engine)):  # hybrid models: the state is pulled at import, unlocked
        pull = SerializedTransport(pull)  # prefetch threads and imports share it
        prefetches = Prefetches(engine, pull)

    def transfer_steps(
        desc: HandoffDescriptor, timeout_s: float, prefill_address: str
    ) -> tuple[TransferStep | None, StateStep | None]:
        """The KV step and (hybrid models) the recurrent-state step; None: the default pull step
        of `transport`. Raises TransferError for a mismatch."""
        if desc.transport_kind == "torch_dist":
            if not isinstance(transport, TorchDistTransport):
                raise TransferError(f"handoff over torch_dist but this decode worker runs {transport.kind or 'another transport'}")
            if not prefill_address:  # command args: the same on every rank
                raise TransferError("a torch_dist handoff needs the prefill worker's address to ask for the push")
            ask = None
            if state is not None and state.ask_push is not None:
                ask = functools.partial(state.ask_push, prefill_address)
            state_step = None
            if has_recurrent_state(engine):  # a second push, after the KV's
                from splitserve.engine.handoff_push_state import state_receive_step

                state_step = state_receive_step(engine, transport, desc, ask, timeout_s)
            return transport.receive_step(engine, desc, ask, timeout_s), state_step
        if not isinstance(transport, KVTransport) or (transport.kind and transport.kind != desc.transport_kind):
            raise TransferError(f"handoff over {desc.transport_kind} but this decode worker runs {transport.kind}")
        return None, None

    def import_handler(engine: Engine, command: Command) -> ImportOutcome:
        started = time.monotonic()
        token_ids, params, desc, timeout_s, *rest = command.args
        prefill_address = rest[0] if rest else ""
        stats: list[TransferStats] = []
        transfer, state_step = transfer_steps(desc, timeout_s, prefill_address)
        prefetch = prefetches.take(command.request_id, desc) if prefetches is not None else None
        try:
            if prefetch is not None:
                transfer = prefetches.transfer_step(prefetch, pull_step(engine, pull, desc, timeout_s), timeout_s)
            importer = make_importer(engine, pull, desc, timeout_s, stats, transfer=transfer, state_step=state_step,
                                     checked=prefetch.checked if prefetch is not None else None)  # fmt: skip
        except BaseException:
            if prefetch is not None:  # never imported: stop it, give its blocks back
                prefetches.discard(command.request_id, prefetch)
            raise
        try:
            reused = engine.add_imported_request(
                command.request_id, token_ids, params, desc.first_token_id, desc.first_token_logprob, importer,
                reserved=prefetch is not None,
            )
        except TransferError as exc:
            # Every rank gets here together (the importer votes). After a refused push or a checksum
            # mismatch the pair's stream is still in step; any other failure may leave it out of
            # step (a late send, a half-received buffer): start afresh with a new group.
            is_push = isinstance(transport, TorchDistTransport) and desc.transport_kind == "torch_dist"
            if is_push and not isinstance(exc, (ChecksumMismatchError, PushRefusedError)):
                transport.forget_source(desc)
            raise
        return ImportOutcome(reused, stats[0] if stats else None, started, time.monotonic(),
                             layout_text(engine_layout(engine)), prefetch is not None)  # fmt: skip

    handlers = {"import": import_handler, "block_set": lambda e, c: e.pool.cached_hashes()}
    hooks = {"handlers": handlers, "on_outputs": state.deliver if state is not None else None, "state": state}
    if prefetches is not None:

        aborted = RecentIds(ABORTED_REMEMBERED)

        def prefetch_handler(engine: Engine, command: Command) -> None:
            token_ids, preview = command.args
            if engine.has_request(command.request_id):  # a late preview: its Decode came first
                raise ValueError(f"request {command.request_id!r} is already running here")
            if command.request_id in aborted:  # its Abort overtook this Prefetch (two RPCs, no order)
                raise ValueError(f"request {command.request_id!r} was aborted here")
            prefetches.start(command.request_id, token_ids, preview)

        def abort(engine: Engine, command: Command) -> bool:
            aborted.add(command.request_id)
            dropped = prefetches.drop(command.request_id)
            return bool(engine.abort(command.request_id)) or dropped

        def add(engine: Engine, command: Command) -> None:  # served here after all: the prefetch is moot
            prefetches.drop(command.request_id)
            engine.add_request(command.request_id, *command.args)

        handlers.update(
            prefetch=prefetch_handler, abort=abort, add=add, drop_prefetch=lambda e, c: prefetches.drop(c.request_id)
        )
        hooks["housekeeping"] = lambda: [Command("drop_prefetch", rid) for rid in prefetches.expired()]
        hooks["after_step"] = lambda engine, outputs: prefetches.collect()
        if state is not None:
            state.accepts_prefetch = True
    return hooks
