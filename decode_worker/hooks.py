"""Decode role, on every rank: the "import" command pulls a handoff's KV into
freshly allocated blocks (a collective: every rank pulls its part of the
plan, then the group votes and verifies checksums) and admits the request.
With torch_dist the transfer step instead asks the prefill worker to push
(rank 0, through `DecodeState.ask_push`) and every rank receives its part.
Hybrid models move the recurrent state with the KV (`make_importer`; torch_dist: a second push,
engine/handoff_push_state.py). Rank 0 forwards each step's outputs to the streams waiting for them."""

from __future__ import annotations

import asyncio
import functools
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
)
from splitserve.engine.handoff_push import (
    PushGrant,
    PushRefusedError,
    PushRequest,
    TorchDistEndpoint,
    TorchDistTransport,
)
from splitserve.engine.serving import Command
from splitserve.engine.state_handoff import StateStep, has_recurrent_state
from splitserve.engine.transfer.layout import layout_text
from splitserve.engine.transfer.transport import KVTransport, TransferError, TransferStats, TransportEndpoint


@dataclass(frozen=True)
class ImportOutcome:
    num_reused_blocks: int
    stats: TransferStats | None
    started: float = 0.0
    """`time.monotonic()` when the import command began on the engine thread (queue wait ends)."""
    finished: float = 0.0
    dst_layout: str = ""
    """The decode side's KV layout (engine/transfer/layout.py `layout_text`)."""


@dataclass
class DecodeState:
    """Rank 0: the asyncio queue of every open Decode stream."""

    streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = field(default_factory=dict)
    ask_push: Callable[[str, PushRequest], PushGrant] | None = None
    """torch_dist: `ask_push(prefill_address, request)` calls PushKV (set by the service;
    called from the engine thread, blocking, within the request's deadline)."""

    def deliver(self, out: StepOutput) -> None:
        entry = self.streams.get(out.request_id)
        if entry is not None:
            loop, queue = entry
            loop.call_soon_threadsafe(queue.put_nowait, out)


def decode_hooks(engine: Engine, transport: TransportEndpoint, endpoints: dict[int, RankEndpoint] | None) -> dict:
    state = DecodeState() if endpoints is not None else None
    if isinstance(transport, TorchDistTransport) and endpoints is not None:
        transport.group_endpoints = [TorchDistEndpoint.from_bytes(e.agent_metadata) for e in endpoints.values()]

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
        pull = transport if isinstance(transport, KVTransport) else None
        try:
            reused = engine.add_imported_request(
                command.request_id,
                token_ids,
                params,
                desc.first_token_id,
                desc.first_token_logprob,
                make_importer(engine, pull, desc, timeout_s, stats, transfer=transfer, state_step=state_step),
            )
        except TransferError as exc:
            # Every rank gets here together (the importer votes). After a refused push or a checksum
            # mismatch the pair's stream is still in step; any other failure may leave it out of
            # step (a late send, a half-received buffer): start afresh with a new group.
            if transfer is not None and not isinstance(exc, (ChecksumMismatchError, PushRefusedError)):
                transport.forget_source(desc)
            raise
        return ImportOutcome(reused, stats[0] if stats else None, started, time.monotonic(), layout_text(engine_layout(engine)))

    return {
        "handlers": {"import": import_handler, "block_set": lambda e, c: e.pool.cached_hashes()},
        "on_output": state.deliver if state is not None else None,
        "state": state,
    }
