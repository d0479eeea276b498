"""Typed requests and results of the SDK (no protobuf here; convert.py translates).

Field names follow the engine's `SamplingParams` / `GenerationResult` (and so
the reference design), so code moves between `LLM.generate` and
`Client.generate` unchanged.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from splitserve.engine.guided import check_schema
from splitserve.engine.logit_adjustments import bias_pairs, check_penalty


class FinishReason(enum.Enum):
    STOP = "stop"
    """A termination id (EOS) or stop word ended the output."""
    LENGTH = "length"
    """num_tokens_to_generate was reached."""
    ABORT = "abort"
    """Aborted (Client.abort, a drain, or the router)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to continue one prompt; validated on construction, errors quote the value."""

    num_tokens_to_generate: int = 16
    """Maximum new tokens."""
    temperature: float = 1.0
    """Softmax temperature; 0.0 means greedy."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""
    top_p: float = 0.0
    """Nucleus threshold in (0, 1] (0.0 = off)."""
    seed: int | None = None
    """Seed of this request's sampling; None lets the engine pick."""
    termination_id: int | None = None
    """Token id that ends generation; None uses the model's EOS ids."""
    stop_words: tuple[str, ...] = ()
    """Strings that end generation when they appear in the generated text."""
    return_log_probs: bool = False
    """Return the log-prob of every generated token."""
    top_n_logprobs: int = 0
    """Also return the N most likely alternatives per generated token (at most 20)."""
    return_prompt_log_probs: bool = False
    """Also return the prompt tokens' log-probs (after the first; with top_n_logprobs alternatives
    each), as scoring harnesses ask (OpenAI's `echo` with `logprobs`). Needs return_log_probs.
    The worker computing the prompt then skips its prefix cache: every position's logits are needed."""
    add_BOS: bool = True  # noqa: N815 - the reference design's field name
    """Prepend the tokenizer's BOS token to text prompts."""
    output_offset: int = 0
    """The prompt's last `output_offset` tokens were generated earlier (a stream resumed from
    them): sampling positions and stop-word matching go on from there. The SDK sets it when it
    resumes a broken stream (client/resume.py)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before sampling, greedy included ([-100, 100]);
    a {token id: bias} dict is accepted and stored sorted."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output already holds ([-2, 2])."""
    frequency_penalty: float = 0.0
    """Subtracted once per occurrence of a token in the output so far ([-2, 2])."""
    json_schema: str | None = None
    """The JSON text of a JSON schema the output must follow (`{"type": "object"}`: any JSON object)."""
    grammar: str | None = None
    """Or an llguidance Lark grammar it must follow (`%json {...}` embeds a schema)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop_words, str):
            object.__setattr__(self, "stop_words", (self.stop_words,))
        elif not isinstance(self.stop_words, tuple):
            object.__setattr__(self, "stop_words", tuple(self.stop_words))
        if not _is_int(self.num_tokens_to_generate) or self.num_tokens_to_generate < 1:
            raise ValueError(f"num_tokens_to_generate must be a positive integer, got {self.num_tokens_to_generate!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.termination_id is not None and (not _is_int(self.termination_id) or self.termination_id < 0):
            raise ValueError(f"termination_id must be a non-negative token id, got {self.termination_id!r}")
        if not _is_int(self.output_offset) or self.output_offset < 0:
            raise ValueError(f"output_offset must be an integer >= 0, got {self.output_offset!r}")
        if not _is_int(self.top_n_logprobs) or not 0 <= self.top_n_logprobs <= 20:
            raise ValueError(f"top_n_logprobs must be an integer in [0, 20], got {self.top_n_logprobs!r}")
        if self.return_prompt_log_probs and not self.return_log_probs:
            raise ValueError("return_prompt_log_probs needs return_log_probs=True, got return_log_probs=False")
        for word in self.stop_words:
            if not isinstance(word, str) or not word:
                raise ValueError(f"stop_words must be non-empty strings, got {word!r}")
        object.__setattr__(self, "logit_bias", bias_pairs(self.logit_bias))
        check_penalty("presence_penalty", self.presence_penalty)
        check_penalty("frequency_penalty", self.frequency_penalty)
        if self.json_schema is not None:
            check_schema(self.json_schema)
        if self.grammar is not None and (self.json_schema is not None or not self.grammar.strip()):
            raise ValueError(f"grammar must be a non-empty Lark grammar and excludes json_schema, got {self.grammar!r:.80}")

    @classmethod
    def coerce(cls, params: object) -> SamplingParams:
        """`params` as the SDK's SamplingParams: itself, or the engine's (`splitserve.SamplingParams`,
        what `LLM.generate` takes) field by field, so code moves between the two unchanged.
        ValueError for an engine option the router's API cannot carry (named); TypeError else."""
        if isinstance(params, cls):
            return params
        if type(params).__module__ != "splitserve.engine.sampling_params":  # by name: no engine import here
            raise TypeError(f"params must be splitserve.client.SamplingParams (or splitserve.SamplingParams), "
                            f"got {type(params).__name__}")
        unsupported = {name: getattr(params, name) for name, default in _ENGINE_ONLY.items()
                       if getattr(params, name, default) != default}
        if unsupported:
            raise ValueError(f"the router's API cannot carry {unsupported} (engine-only SamplingParams options)")
        fields = {name: getattr(params, name) for name in cls.__dataclass_fields__ if name not in _SDK_ONLY}
        return cls(**fields)


_ENGINE_ONLY = {"num_tokens_total": None, "detokenize_stop_sequence": False, "return_prompt_tokens": False,
                "ignore_eos": False}
"""Engine SamplingParams options with no field in the router's API, at their defaults (its
`skip_prompt_log_probs` needs none: prompt log-probs are asked for only by name, below)."""
_SDK_ONLY = ("return_prompt_log_probs",)
"""Left at their defaults when coercing: the engine's `return_log_probs` alone implies prompt
log-probs, which cost the prefix cache, so the SDK asks for them only explicitly."""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    """Prompt tokens served from a worker's prefix cache."""


@dataclass(frozen=True)
class RoutingInfo:
    """Where the request ran and why (the router's RoutingSummary)."""

    prefill_worker_id: str | None
    """None when the decode worker prefilled the prompt itself."""
    decode_worker_id: str
    predicted_cached_tokens: int
    reason: str
    num_prefill_attempts: int
    num_decode_attempts: int
    num_transfer_blocks: int


@dataclass(frozen=True)
class TimingInfo:
    """The router's wall-clock milliseconds (with `return_timing=True`)."""

    route_ms: float
    prefill_ms: float
    time_to_first_token_ms: float
    total_ms: float


@dataclass(frozen=True)
class GenerateResult:
    """One finished request."""

    request_id: str
    prompt_tokens: tuple[int, ...]
    generated_tokens: tuple[int, ...]
    generated_text: str | None
    """None when the client has no tokenizer."""
    finish_reason: FinishReason
    usage: Usage
    generated_log_probs: tuple[float, ...] = ()
    """One per generated token with return_log_probs."""
    top_n_logprobs: tuple[Mapping[int, float], ...] = ()
    """One {token id: log-prob} per generated token with top_n_logprobs > 0."""
    prompt_log_probs: tuple[float, ...] | None = None
    """With return_prompt_log_probs: one per prompt token after the first, given those before it."""
    prompt_top_logprobs: tuple[Mapping[int, float], ...] | None = None
    """With return_prompt_log_probs and top_n_logprobs > 0: one {token id: log-prob} per entry of
    prompt_log_probs."""
    routing: RoutingInfo | None = None
    timing: TimingInfo | None = None
    ttft: float | None = None
    """Seconds from sending the request to its first token, measured by the client."""

    @property
    def prompt_length(self) -> int:
        return len(self.prompt_tokens)

    @property
    def num_cached_tokens(self) -> int:
        return self.usage.cached_tokens


@dataclass(frozen=True)
class StreamChunk:
    """What `stream()` yields: the new tokens since the previous chunk; `result` on the last one."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    """The text the new tokens complete ("" without a tokenizer, or while a UTF-8 sequence is open)."""
    logprobs: tuple[float, ...] = ()
    top_logprobs: tuple[Mapping[int, float], ...] = ()
    prompt_log_probs: tuple[float, ...] | None = None
    """On the first token's chunk with return_prompt_log_probs (see GenerateResult.prompt_log_probs)."""
    prompt_top_logprobs: tuple[Mapping[int, float], ...] = ()
    result: GenerateResult | None = None
    """Set on the last chunk only."""

    @property
    def is_last(self) -> bool:
        return self.result is not None


class LifecycleState(enum.Enum):
    RUNNING = "running"
    PAUSED = "paused"
    SUSPENDED = "suspended"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class LifecycleStatus:
    state: LifecycleState
    weights_version: int
    checkpoint_path: str | None


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    address: str
    role: str | None
    """"prefill", "decode", or None when it registered for any role."""
    slot_ids: tuple[int, ...]
    is_draining: bool


@dataclass(frozen=True)
class SlotInfo:
    slot_id: int
    group_index: int
    role: str
    dp_replica: int
    tp_rank: int
    pp_rank: int
    tp: int
    pp: int
    worker_id: str | None
    """None while the slot is free."""


@dataclass(frozen=True)
class ClusterTopology:
    revision: int
    inference_shards: str
    lifecycle: LifecycleStatus
    slots: tuple[SlotInfo, ...] = field(default_factory=tuple)
    workers: tuple[WorkerInfo, ...] = field(default_factory=tuple)
    leader_address: str | None = None

    @property
    def is_complete(self) -> bool:
        """Every slot of the spec is filled."""
        return all(slot.worker_id for slot in self.slots)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
