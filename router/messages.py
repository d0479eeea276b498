"""The router's typed messages: requests, output chunks, worker replies and KV events.

These are what the orchestrator, the KV-event subscriber and the policy see;
protobuf stays at the boundary (service.py converts both ways).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import grpc

from splitserve.engine.block_hash import BlockHash


class FinishReason(enum.Enum):
    STOP = "stop"
    """A termination id or stop word was produced."""
    LENGTH = "length"
    """num_tokens_to_generate was reached."""
    ABORT = "abort"
    """Aborted by the client, the router or a drain."""


@dataclass(frozen=True)
class SamplingParams:
    """The common.proto SamplingParams the router forwards; it reads only the token budget."""

    num_tokens_to_generate: int
    """Maximum new tokens, the first (prefill) token included."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int | None = None
    termination_ids: tuple[int, ...] = ()
    stop_words: tuple[str, ...] = ()
    return_log_probs: bool = False
    top_n_logprobs: int = 0
    output_offset: int = 0
    """Generated tokens at the end of the prompt (set on a resumed stream's continuation)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    json_schema: str = ""
    """The schema the output follows ("" = free text): every worker that samples applies it."""
    grammar: str = ""
    """Or the Lark grammar it follows, likewise."""
    return_prompt_log_probs: bool = False
    """Asked of whichever worker computes the prompt first (the prefill worker, or the decode worker
    serving aggregated); never of a decode worker that imports a handoff or goes on after sent tokens."""

    def __post_init__(self) -> None:
        value = self.num_tokens_to_generate
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"num_tokens_to_generate must be a positive integer, got {value!r}")
        if self.top_n_logprobs < 0:
            raise ValueError(f"top_n_logprobs must be >= 0, got {self.top_n_logprobs!r}")
        if self.output_offset < 0:
            raise ValueError(f"output_offset must be >= 0, got {self.output_offset!r}")


@dataclass(frozen=True)
class GenerateRequest:
    """One Router.Generate call."""

    request_id: str
    token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    return_timing: bool = False
    enforce_disagg: bool | None = None
    """Overrides the router's enforce_disagg when not None."""

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        if not self.token_ids:
            raise ValueError(f"token_ids must hold at least one token, got {self.token_ids!r}")
        if any(t < 0 for t in self.token_ids):
            raise ValueError(f"token ids must be >= 0, got {min(self.token_ids)!r}")


TopLogprobs = tuple[tuple[int, float], ...]
"""(token id, log-prob) alternatives of one position."""


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt tokens' log-probs after the first (each given the tokens before it)."""

    logprobs: tuple[float, ...]
    top_logprobs: tuple[TopLogprobs, ...] = ()
    """Empty, or one per entry of logprobs."""


@dataclass(frozen=True)
class Tokens:
    """Consecutive generated tokens with their optional log-probs."""

    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    """Empty, or one per token."""
    top_logprobs: tuple[TopLogprobs, ...] = ()
    """Empty, or one per token."""
    prompt: PromptLogprobs | None = None
    """On a request's first token only: the prompt's log-probs, when asked for."""

    def __post_init__(self) -> None:
        for name in ("logprobs", "top_logprobs"):
            if getattr(self, name) and len(getattr(self, name)) != len(self.token_ids):
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {len(self.token_ids)} tokens")

    def drop_first(self) -> Tokens:
        return Tokens(self.token_ids[1:], self.logprobs[1:], self.top_logprobs[1:])


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class RoutingSummary:
    prefill_worker_id: str | None
    decode_worker_id: str
    predicted_cached_tokens: int
    reason: str
    num_prefill_attempts: int
    num_decode_attempts: int
    num_transfer_blocks: int


@dataclass(frozen=True)
class TimingPhase:
    """One measured part of a request (names in router.proto's TimingPhase)."""

    name: str
    ms: float
    is_ttft: bool
    """On the path from the request's arrival to its first token."""


@dataclass(frozen=True)
class TimingSummary:
    route_ms: float
    prefill_ms: float
    time_to_first_token_ms: float
    total_ms: float
    phases: tuple[TimingPhase, ...] = ()
    trace_id: str = ""
    kv_transfer_bytes: int = 0
    kv_transfer_gbps: float = 0.0


@dataclass(frozen=True)
class OutputChunk:
    """One Router.Generate stream message; the summaries are on the last chunk only."""

    tokens: Tokens
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    routing: RoutingSummary | None = None
    timing: TimingSummary | None = None


# ------------------------------------------------------------- worker replies
@dataclass(frozen=True)
class PrefillTiming:
    """PrefillResponse.timing: milliseconds measured on the prefill worker."""

    handler_ms: float
    queue_ms: float
    compute_ms: float
    publish_ms: float
    num_chunks: int
    first_token_ms: float = 0.0
    """PrefillStream: call received to the first-token event sent (0: unary Prefill, publish_ms on the TTFT path)."""


@dataclass(frozen=True)
class DecodeTiming:
    """DecodeChunk.timing (last chunk): milliseconds measured on the decode worker."""

    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    transfer_ms: float = 0.0
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0
    transport: str = ""
    first_step_ms: float = 0.0
    first_chunk_ms: float = 0.0
    stream_ms: float = 0.0
    prefetched: bool = False
    """The KV came from a layer-wise prefetch started while prefill was computing."""


class WorkerCallError(RuntimeError):
    """A call to a worker failed; `code` is the gRPC status."""

    def __init__(self, worker_id: str, method: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{method} on worker {worker_id!r} failed: {code.name}: {details}")
        self.worker_id = worker_id
        self.method = method
        self.code = code
        self.details = details

    @property
    def is_request_error(self) -> bool:
        """The request itself is bad: retrying it elsewhere would fail the same way."""
        return self.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)


@dataclass(frozen=True)
class PrefillFirstToken:
    """PrefillWorker.PrefillStream's first event: the first token, sent before its handoff is published."""

    first: Tokens
    """One entry."""
    finish_reason: FinishReason | None = None
    """Set when this token already ends the request (the PrefillResult follows with nothing pinned)."""


@dataclass(frozen=True)
class PrefillHandoffStarted:
    """PrefillStream's optional first event (layer-wise streaming): the handoff's preview, sent as the
    forward pass that completes the prompt starts; the router passes it to DecodeWorker.Prefetch."""

    preview: bytes
    """The serialized preview HandoffDescriptor (no first token, no checksums): opaque to the router."""


@dataclass(frozen=True)
class PrefillResult:
    """PrefillWorker.Prefill's reply (PrefillStream's last event)."""

    first: Tokens
    """The first generated token (one entry)."""
    num_cached_tokens: int
    finish_reason: FinishReason | None
    """Set when the first token ends the request (nothing is pinned then)."""
    handoff: bytes
    """The serialized HandoffDescriptor: opaque to the router, passed on to Decode as is; empty when
    `finish_reason` is set."""
    lease_deadline_unix_ms: int = 0
    timing: PrefillTiming | None = None


@dataclass(frozen=True)
class DecodeOutput:
    """One DecodeWorker.Decode stream message."""

    tokens: Tokens
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    timing: DecodeTiming | None = None
    """On the last message only."""


@dataclass(frozen=True)
class BlockSetSnapshot:
    """A worker's whole prefix cache (GetBlockSet), as of KV event `event_sequence`."""

    block_hashes: frozenset[BlockHash]
    block_size: int
    event_sequence: int


# ------------------------------------------------------------------ KV events
@dataclass(frozen=True)
class BlocksStored:
    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    block_size: int


@dataclass(frozen=True)
class BlocksRemoved:
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlocksStored | BlocksRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventBatch:
    """One ZMQ message of a worker's KV-event stream."""

    worker_id: str
    sequence: int
    events: tuple[KVEvent, ...] = field(default_factory=tuple)
