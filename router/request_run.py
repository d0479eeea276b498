"""`RequestRun`: the orchestrator's book-keeping of one running request, and the retry helpers.

Everything here is pure (no I/O), so the retry rules are testable alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import grpc

from splitserve.router.messages import (
    FinishReason,
    GenerateRequest,
    OutputChunk,
    RoutingSummary,
    TimingSummary,
    Tokens,
    Usage,
)
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
    num_cached_tokens: int = 0
    route_ms: float = 0.0
    prefill_ms: float = 0.0
    first_token_at: float | None = None

    def last_chunk(self, tokens: Tokens, finish_reason: FinishReason, now: float) -> OutputChunk:
        """The final chunk: `tokens` plus usage, routing and (if asked) timing summaries."""
        usage = Usage(len(self.request.token_ids), self.num_completion_tokens, self.num_cached_tokens)
        routing = RoutingSummary(
            self.prefill_worker_id, self.decode_worker_id, self.predicted_cached_tokens, self.reason,
            self.num_prefill_attempts, self.num_decode_attempts, self.num_transfer_blocks,
        )  # fmt: skip
        timing = None
        if self.request.return_timing:
            first = self.first_token_at if self.first_token_at is not None else now
            timing = TimingSummary(self.route_ms, self.prefill_ms, (first - self.started) * 1e3, (now - self.started) * 1e3)
        return OutputChunk(tokens, finish_reason, usage, routing, timing)


def is_handoff_reusable(code: grpc.StatusCode, lease_deadline_unix_ms: int, now_unix_ms: float) -> bool:
    """May a decode retry pull the same pinned copy? Only if the failed worker was unreachable (so it
    never pulled or released it) and the pin's lease (0 = none given) outlasts the retry."""
    is_leased = lease_deadline_unix_ms == 0 or lease_deadline_unix_ms > now_unix_ms + LEASE_MARGIN_MS
    return code is grpc.StatusCode.UNAVAILABLE and is_leased


def continuation(request: GenerateRequest, sent: Tokens) -> GenerateRequest:
    """What a decode worker prefills itself to go on after `sent`: the prompt plus the tokens already
    sent, with that many fewer to generate (the budget must leave at least one)."""
    params = request.sampling_params
    params = replace(params, num_tokens_to_generate=params.num_tokens_to_generate - len(sent.token_ids))
    return replace(request, token_ids=request.token_ids + sent.token_ids, sampling_params=params)
