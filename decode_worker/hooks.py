"""Decode role, on every rank: the "import" command pulls a handoff's KV into
freshly allocated blocks (a collective: every rank pulls its part of the
plan, then the group votes and verifies checksums) and admits the request.
Rank 0 forwards each step's outputs to the streams waiting for them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from splitserve.engine.engine import Engine, StepOutput
from splitserve.engine.handoff import RankEndpoint, make_importer
from splitserve.engine.serving import Command
from splitserve.engine.transfer.transport import KVTransport, TransferStats


@dataclass(frozen=True)
class ImportOutcome:
    num_reused_blocks: int
    stats: TransferStats | None


@dataclass
class DecodeState:
    """Rank 0: the asyncio queue of every open Decode stream."""

    streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = field(default_factory=dict)

    def deliver(self, out: StepOutput) -> None:
        entry = self.streams.get(out.request_id)
        if entry is not None:
            loop, queue = entry
            loop.call_soon_threadsafe(queue.put_nowait, out)


def decode_hooks(engine: Engine, transport: KVTransport, endpoints: dict[int, RankEndpoint] | None) -> dict:
    state = DecodeState() if endpoints is not None else None

    def import_handler(engine: Engine, command: Command) -> ImportOutcome:
        token_ids, params, desc, timeout_s = command.args
        stats: list[TransferStats] = []
        reused = engine.add_imported_request(
            command.request_id,
            token_ids,
            params,
            desc.first_token_id,
            desc.first_token_logprob,
            make_importer(engine, transport, desc, timeout_s, stats),
        )
        return ImportOutcome(reused, stats[0] if stats else None)

    return {
        "handlers": {"import": import_handler, "block_set": lambda e, c: e.pool.cached_hashes()},
        "on_output": state.deliver if state is not None else None,
        "state": state,
    }
