"""Prefill role, on every rank: after a step, each request that reached its
handoff gets its block checksums computed (a collective over the group); rank 0
then builds the descriptor and wakes the waiting `Prefill` call."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

from splitserve.engine.engine import Engine, StepOutput
from splitserve.engine.handoff import HandoffDescriptor, RankEndpoint, build_descriptor, group_block_checksums
from splitserve.engine.request import GenerationResult
from splitserve.engine.transfer.transport import KVTransport


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

    def resolve(self, request_id: str, outcome: PrefillOutcome) -> None:
        future = self.waiters.pop(request_id, None)
        if future is not None and not future.done():
            future.set_result(outcome)


def prefill_hooks(engine: Engine, transport: KVTransport, endpoints: dict[int, RankEndpoint] | None) -> dict:
    kind = "nixl" if type(transport).__name__.lower().startswith("nixl") else "inproc"
    state = PrefillState(kind, endpoints) if endpoints is not None else None

    def after_step(engine: Engine, outputs: list[StepOutput]) -> None:
        for out in outputs:
            result = out.result
            if result.status == "handoff":
                handoff = engine.handoffs[out.request_id]
                checksums = group_block_checksums(engine, handoff.block_ids)  # every rank
                if state is not None:
                    top = result.top_n_logprobs[0] if result.top_n_logprobs else None
                    desc = build_descriptor(engine, handoff, state.endpoints, state.transport_kind, checksums, top)
                    state.resolve(out.request_id, PrefillOutcome(result, desc))
            elif result.is_finished and state is not None:
                state.resolve(out.request_id, PrefillOutcome(result, None))

    return {
        "after_step": after_step,
        "handlers": {"block_set": lambda e, c: e.pool.cached_hashes()},
        "state": state,
    }
