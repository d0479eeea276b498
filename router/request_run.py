"""`RequestRun`: the orchestrator's book-keeping of one running request, and the retry helpers.

Everything here is pure (no I/O), so the retry rules are testable alone.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

import grpc

from splitserve.router.messages import (
    DecodeTiming,
    FinishReason,
    GenerateRequest,
    OutputChunk,
    PrefillTiming,
    RoutingSummary,
    TimingSummary,
    Tokens,
    Usage,
    WorkerCallError,
)
from splitserve.router.timing import RouterTimes, phases
from splitserve.router.workers import WorkerEndpoint

LEASE_MARGIN_MS = 1000
"""A pinned handoff is reused by a retry only if its lease has at least this long left."""


@dataclass
class RequestRun:
    """Mutable state of one request, owned by its Generate call (one event loop)."""

    request: GenerateRequest
    started: float
    """time.monotonic() at arrival."""
    hashes: list[bytes] = field(default_factory=list)
    touched: dict[str, WorkerEndpoint] = field(default_factory=dict)
    """Workers that may hold state of the request: Abort goes to these on cancellation."""
    is_aborted: bool = False
    is_finished: bool = False
    prefill_worker_id: str | None = None
    decode_worker_id: str = ""
    predicted_cached_tokens: int = 0
    reason: str = ""
    num_transfer_blocks: int = 0
    num_prefill_attempts: int = 0
    num_decode_attempts: int = 0
    num_completion_tokens: int = 0
    sent_token_ids: list[int] = field(default_factory=list)
    """Every token handed to the caller so far (a resumed stream goes on after them)."""
    num_cached_tokens: int = 0
    route_ms: float = 0.0
    prefill_ms: float = 0.0
    """Prefill calls, failed ones included, each until its last message."""
    prefill_failed_ms: float = 0.0
    """Prefill calls that failed before their first token (on the TTFT path, like the one that answered)."""
    first_token_at: float | None = None
    """time.monotonic() when the first token was handed to the caller (Router.Generate)."""
    first_token_sent_at: float | None = None
    """time.monotonic() when the caller came back for more after the first token (it was written)."""
    first_token_in_hand_at: float | None = None
    """time.monotonic() when the first token reached the router (prefill reply or first decode chunk)."""
    prefill_call_ms: float = 0.0
    """The Prefill call that produced the first token, until that token."""
    decode_call_started: float | None = None
    decode_first_chunk_ms: float = 0.0
    prefill_timing: PrefillTiming | None = None
    decode_timing: DecodeTiming | None = None
    trace_id: str = ""
    prefetch: asyncio.Task | None = None
    """Layer-wise streaming: the DecodeWorker.Prefetch call of the handoff's preview (prefill_call.py);
    Decode waits for it, so the decode worker sees the prefetch before the import."""
    prefetch_failure: WorkerCallError | None = None
    """That call failed for want of an answer (the worker hung or went away, not a refusal): the relay
    counts it as the decode worker's failed attempt and goes elsewhere without calling Decode there."""

    def last_chunk(self, tokens: Tokens, finish_reason: FinishReason, now: float) -> OutputChunk:
        """The final chunk: `tokens` plus usage, routing and (if asked) timing summaries."""
        usage = Usage(len(self.request.token_ids), self.num_completion_tokens, self.num_cached_tokens)
        routing = RoutingSummary(
            self.prefill_worker_id, self.decode_worker_id, self.predicted_cached_tokens, self.reason,
            self.num_prefill_attempts, self.num_decode_attempts, self.num_transfer_blocks,
        )  # fmt: skip
        timing = self.timing_summary(now) if self.request.return_timing else None
        return OutputChunk(tokens, finish_reason, usage, routing, timing)

    @property
    def ttft_s(self) -> float | None:
        """Arrival to the first token sent (written to the caller, when known)."""
        first = self.first_token_sent_at or self.first_token_at
        return None if first is None else first - self.started

    def timing_summary(self, now: float) -> TimingSummary:
        ttft = self.ttft_s
        ttft_ms = (now - self.started) * 1e3 if ttft is None else ttft * 1e3
        relay_ms = 0.0
        if self.first_token_in_hand_at is not None and self.first_token_sent_at is not None:
            relay_ms = (self.first_token_sent_at - self.first_token_in_hand_at) * 1e3
        times = RouterTimes(
            self.route_ms, self.prefill_failed_ms, self.prefill_call_ms,
            self.decode_first_chunk_ms, relay_ms,
        )  # fmt: skip
        d = self.decode_timing
        prefill = self.prefill_timing if self.prefill_worker_id is not None else None
        transfer_bytes = d.transfer_bytes if d is not None else 0
        gbps = transfer_bytes / d.transfer_seconds / 1e9 if d is not None and d.transfer_seconds > 0 else 0.0
        return TimingSummary(
            self.route_ms, self.prefill_ms, ttft_ms, (now - self.started) * 1e3, phases(times, prefill, d),
            self.trace_id, transfer_bytes, gbps,
        )  # fmt: skip


def is_handoff_reusable(code: grpc.StatusCode, lease_deadline_unix_ms: int, now_unix_ms: float) -> bool:
    """May a decode retry pull the same pinned copy? Only if the failed worker was unreachable (so it
    never pulled or released it) and the pin's lease (0 = none given) outlasts the retry."""
    is_leased = lease_deadline_unix_ms == 0 or lease_deadline_unix_ms > now_unix_ms + LEASE_MARGIN_MS
    return code is grpc.StatusCode.UNAVAILABLE and is_leased


def continuation(request: GenerateRequest, sent: Tokens) -> GenerateRequest:
    """What a decode worker prefills itself to go on after `sent`: the prompt plus the tokens already
    sent, with that many fewer to generate (the budget must leave at least one), its sampling
    positions counted on past them (`output_offset`).

    It goes on as the broken worker would have: greedy tokens do, a sampled token's seed is its
    (request seed, output position), the position counted on past the sent tokens; a request
    without a seed goes on with the next worker's own, as any unseeded draw may. Stop words are
    matched across the break: the worker keeps the tail of the sent tokens' text (`output_offset`
    tells it they are output: engine/stop.py), so one begun before the break still stops it."""
    params = request.sampling_params
    params = replace(params, num_tokens_to_generate=params.num_tokens_to_generate - len(sent.token_ids),
                     output_offset=params.output_offset + len(sent.token_ids),
                     return_prompt_log_probs=False)  # sent with the first token
    return replace(request, token_ids=request.token_ids + sent.token_ids, sampling_params=params)
