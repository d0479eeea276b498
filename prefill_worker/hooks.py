"""Prefill role, on every rank: after a step, each request that reached its
handoff gets its block checksums (and, for a hybrid model, its recurrent-state
checksum) computed (collectives over the group); rank 0 then builds the descriptor and wakes the waiting `Prefill` call. With the
torch_dist transport, the "push" command sends a pinned request's KV to the
decode worker that asked (engine/handoff_push.py)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from dataclasses import dataclass, field

from splitserve.engine.engine import Engine, StepOutput
from splitserve.engine.handoff import HandoffDescriptor, RankEndpoint, build_descriptor, group_block_checksums
from splitserve.engine.handoff_layerwise import close_released, publish_layers
from splitserve.engine.handoff_push import TorchDistTransport, serve_push
from splitserve.engine.request import GenerationResult
from splitserve.engine.state_handoff import build_state_handoff, has_recurrent_state
from splitserve.engine.transfer.transport import TransferStats, TransportEndpoint


@dataclass(frozen=True)
class PrefillOutcome:
    result: GenerationResult
    descriptor: HandoffDescriptor | None
    """None when the first token already finished the request (nothing pinned)."""


@dataclass
class PrefillState:
    """Rank 0's bookkeeping: one future per in-flight Prefill call."""

    transport_kind: str
    endpoints: dict[int, RankEndpoint]
    waiters: dict[str, concurrent.futures.Future] = field(default_factory=dict)
    push_waiters: dict[str, concurrent.futures.Future] = field(default_factory=dict)
    """torch_dist: PushKV calls waiting for the "push" command's decision, by push id."""

    def resolve(self, request_id: str, outcome: PrefillOutcome) -> None:
        future = self.waiters.pop(request_id, None)
        if future is not None and not future.done():
            future.set_result(outcome)


def prefill_hooks(engine: Engine, transport: TransportEndpoint, endpoints: dict[int, RankEndpoint] | None) -> dict:
    kind = transport.kind or ("nixl" if type(transport).__name__.lower().startswith("nixl") else "inproc")
    state = PrefillState(kind, endpoints) if endpoints is not None else None

    def board():  # layer-wise streaming: the transport's progress board (re-made by a re-expose)
        return getattr(transport, "board", None) if engine.config.transfer.layerwise else None

    is_hybrid = has_recurrent_state(engine)

    def after_step(engine: Engine, outputs: list[StepOutput]) -> None:
        if board() is not None:  # first: slots of released pins are free for this step's handoffs
            close_released(engine, board())
        for out in outputs:
            result = out.result
            if result.status == "handoff":
                handoff = engine.handoffs[out.request_id]
                checksums = group_block_checksums(engine, handoff.block_ids)  # every rank
                slot = publish_layers(engine, board(), handoff) if board() is not None else None  # every rank
                recurrent = None
                if is_hybrid:  # every rank: the state checksum is a collective too
                    # Pull transports (NIXL) publish where each rank's state is; torch_dist pushes it.
                    endpoints_of = {r: e.state_metadata for r, e in (state.endpoints if state else {}).items()
                                    if e.state_metadata}
                    recurrent = build_state_handoff(engine, out.request_id, endpoints_of)
                if state is not None:
                    top = result.top_n_logprobs[0] if result.top_n_logprobs else None
                    desc = build_descriptor(engine, handoff, state.endpoints, state.transport_kind, checksums, top,
                                            progress_slot=slot)
                    desc = dataclasses.replace(desc, state=recurrent)
                    state.resolve(out.request_id, PrefillOutcome(result, desc))
            elif result.is_finished and state is not None:
                state.resolve(out.request_id, PrefillOutcome(result, None))

    handlers = {"block_set": lambda e, c: e.pool.cached_hashes()}
    if isinstance(transport, TorchDistTransport):

        def push(engine: Engine, command) -> TransferStats:
            push_id, request = command.args
            waiter = state.push_waiters.get(push_id) if state is not None else None
            return serve_push(engine, transport, request, waiter)

        handlers["push"] = push
    return {"after_step": after_step, "handlers": handlers, "state": state}
