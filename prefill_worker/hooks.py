"""Prefill role, on every rank: after a step, rank 0 first hands every request's
sampled first token to its waiting call (PrefillStream sends it at once: the
time to first token must not include the publication), then each request that
reached its handoff gets its block checksums (and, for a hybrid model, its
recurrent-state checksum) computed (collectives over the group); rank 0 then
builds the descriptor and wakes the waiting `Prefill` / `PrefillStream` call. With
the torch_dist transport, the "push" command sends a pinned request's KV to the
decode worker that asked (engine/handoff_push.py).

The futures are set on the engine thread and read on the service's event loop
(asyncio.wrap_future); either side may get there first, so setting one that the
call meanwhile cancelled is not an error."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from dataclasses import dataclass, field

from splitserve.engine.engine import Engine, StepOutput
from splitserve.engine.handoff import (
    HandoffDescriptor,
    RankEndpoint,
    build_descriptor,
    build_preview,
    group_block_checksums,
)
from splitserve.engine.handoff_layerwise import LayerPublisher, close_released, publish_layers
from splitserve.engine.handoff_pack import make_packer
from splitserve.engine.handoff_push import TorchDistTransport, serve_push
from splitserve.engine.request import GenerationResult
from splitserve.engine.serving import settle
from splitserve.engine.state_handoff import build_state_handoff, has_recurrent_state
from splitserve.engine.transfer.transport import TransferStats, TransportEndpoint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FirstToken:
    """A request's first generated token, known before its handoff is published."""

    token_id: int
    logprob: float | None
    """None unless the request asked for log-probs."""
    top_logprobs: dict[int, float]
    """Empty unless the request asked for top_n_logprobs."""
    finished_as: str | None
    """The request's status when this token already ended it ("stopped", "length"), else None."""
    result: GenerationResult
    """The result it came from (its prompt log-probs, when asked for)."""

    @classmethod
    def of(cls, result: GenerationResult) -> FirstToken:
        logprobs, tops = result.generated_log_probs, result.top_n_logprobs
        return cls(
            result.generated_tokens[0], logprobs[0] if logprobs else None, dict(tops[0]) if tops else {},
            None if result.status == "handoff" else result.status, result,
        )  # fmt: skip


@dataclass(frozen=True)
class PrefillOutcome:
    result: GenerationResult
    descriptor: HandoffDescriptor | None
    """None when the first token already finished the request (nothing pinned)."""


@dataclass
class PrefillState:
    """Rank 0's bookkeeping: futures of the in-flight Prefill / PrefillStream calls, by request id."""

    transport_kind: str
    endpoints: dict[int, RankEndpoint]
    waiters: dict[str, concurrent.futures.Future] = field(default_factory=dict)
    """PrefillOutcome futures: set once the handoff is published (or the request finished)."""
    first_tokens: dict[str, concurrent.futures.Future] = field(default_factory=dict)
    """FirstToken futures: set as soon as the token is sampled, before anything is published."""
    started: dict[str, concurrent.futures.Future] = field(default_factory=dict)
    """Layer-wise streaming: preview HandoffDescriptor futures, set when the forward pass that
    completes the prompt starts (engine/handoff_layerwise.py `LayerPublisher`)."""
    push_waiters: dict[str, concurrent.futures.Future] = field(default_factory=dict)
    """torch_dist: PushKV calls waiting for the "push" command's decision, by push id."""
    decode_tp: dict[str, int] = field(default_factory=dict)
    """TP size of the decode worker the router chose, by request id (PrefillRequest.decode_tp;
    absent = not named): what the handoff's head slices are packed for (engine/handoff_pack.py)."""

    def signal_started(self, request_id: str, preview: HandoffDescriptor) -> None:
        settle(self.started.pop(request_id, None), preview)

    def signal_first_token(self, request_id: str, result: GenerationResult) -> None:
        future = self.first_tokens.pop(request_id, None)
        if future is not None:
            settle(future, FirstToken.of(result))

    def resolve(self, request_id: str, outcome: PrefillOutcome) -> None:
        self.first_tokens.pop(request_id, None)  # normally gone already (signalled just before)
        self.decode_tp.pop(request_id, None)
        settle(self.waiters.pop(request_id, None), outcome)

    def forget(self, request_id: str) -> None:
        """The call is gone (cancelled, timed out, aborted): drop and cancel its futures."""
        self.decode_tp.pop(request_id, None)
        for futures in (self.started, self.first_tokens, self.waiters):
            future = futures.pop(request_id, None)
            if future is not None:
                future.cancel()


def prefill_hooks(engine: Engine, transport: TransportEndpoint, endpoints: dict[int, RankEndpoint] | None) -> dict:
    kind = transport.kind or ("nixl" if type(transport).__name__.lower().startswith("nixl") else "inproc")
    state = PrefillState(kind, endpoints) if endpoints is not None else None

    def board():  # layer-wise streaming: the transport's progress board (re-made by a re-expose)
        return getattr(transport, "board", None) if engine.config.transfer.layerwise else None

    is_hybrid = has_recurrent_state(engine)
    packer = make_packer(engine, transport, (lambda rid: state.decode_tp.get(rid, 0)) if state is not None else None)

    def endpoints_for(request_id: str) -> dict[int, RankEndpoint]:
        return packer.endpoints(request_id, state.endpoints) if packer is not None else state.endpoints

    def on_started(request_id: str, slot: int, block_ids: tuple[int, ...], num_tokens: int) -> None:
        if state is not None and request_id in state.started:  # someone waits for this preview
            state.signal_started(request_id, build_preview(
                engine, request_id, slot, block_ids, num_tokens, endpoints_for(request_id), state.transport_kind))

    if engine.config.transfer.layerwise and hasattr(engine, "runner"):
        engine.runner.layer_listener = LayerPublisher(engine, board, on_started if state is not None else None,
                                                      packer)

    def after_step(engine: Engine, outputs: list[StepOutput]) -> None:
        if board() is not None:  # first: slots of released pins are free for this step's handoffs
            close_released(engine, board())
        if packer is not None:
            packer.release_done()
        if state is not None:  # first tokens out before any checksum: they are the time to first token
            for out in outputs:
                if out.result.is_finished and out.result.generated_tokens:  # a handoff is finished too
                    state.signal_first_token(out.request_id, out.result)
        for out in outputs:
            result = out.result
            if result.status == "handoff":
                handoff = engine.handoffs[out.request_id]
                checksums = group_block_checksums(engine, handoff.block_ids)  # every rank
                if packer is not None:  # packed before any mark or descriptor names it
                    packer.finish(out.request_id, handoff.block_ids)
                slot = publish_layers(engine, board(), handoff) if board() is not None else None  # every rank
                recurrent = None
                if is_hybrid:  # every rank: the state checksum is a collective too
                    # Pull transports (NIXL) publish where each rank's state is; torch_dist pushes it.
                    endpoints_of = {r: e.state_metadata for r, e in (state.endpoints if state else {}).items()
                                    if e.state_metadata}
                    recurrent = build_state_handoff(engine, out.request_id, endpoints_of)
                if state is not None:
                    top = result.top_n_logprobs[0] if result.top_n_logprobs else None
                    desc = build_descriptor(engine, handoff, endpoints_for(out.request_id), state.transport_kind,
                                            checksums, top,
                                            progress_slot=slot)
                    desc = dataclasses.replace(desc, state=recurrent)
                    state.resolve(out.request_id, PrefillOutcome(result, desc))
            elif result.is_finished and state is not None:
                state.resolve(out.request_id, PrefillOutcome(result, None))

    def add(engine: Engine, command) -> None:
        request_id = command.request_id
        if request_id in engine.handoffs:
            # An earlier attempt of this request (same id) left a pinned handoff: its router
            # died, and the retry reached this worker before the lease ran out. That attempt is
            # over; its pins, progress slot and packing go now, or they would leak (the
            # handoff table holds one entry per id) and the retry would read the old slot.
            log.warning("request %s arrived again while an earlier attempt's handoff was pinned: released it",
                        request_id)  # fmt: skip
            engine.release_handoff(request_id)
            if board() is not None:
                board().close(request_id)
            if packer is not None:
                packer.forget(request_id)
        engine.add_request(request_id, *command.args)

    handlers = {"block_set": lambda e, c: e.pool.cached_hashes(), "add": add}
    if isinstance(transport, TorchDistTransport):

        def push(engine: Engine, command) -> TransferStats:
            push_id, request = command.args
            waiter = state.push_waiters.get(push_id) if state is not None else None
            return serve_push(engine, transport, request, waiter)

        handlers["push"] = push
    return {"after_step": after_step, "handlers": handlers, "state": state}
