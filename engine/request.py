"""A request's state inside the engine, and the results handed to callers."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from splitserve.engine.block_hash import BlockHash, hash_blocks
from splitserve.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stopped"  # EOS / termination id / stop word
    FINISHED_LENGTH = "length"  # token limit reached
    FINISHED_ABORTED = "aborted"
    HANDOFF = "handoff"  # prefill role: first token out, blocks pinned for a decode peer

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


_MAX_TEXT_PIECES = 64


@dataclass
class Request:
    """Mutable per-request bookkeeping owned by the scheduler.

    `num_computed_tokens` counts tokens of `all_token_ids` whose KV is in the
    cache; the next forward computes `all_token_ids[num_computed_tokens:]`
    (a prefill chunk, or the one token sampled last step).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_new_tokens: int
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (or imported by a handoff)."""
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_registered_blocks: int = 0
    generated_log_probs: list[float] = field(default_factory=list)
    guide: object | None = None
    """With a json_schema: its matcher, fed every output token (engine/guided.py)."""
    prompt_log_probs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    top_n_logprobs: list[dict[int, float]] = field(default_factory=list)
    first_token_time: float | None = None
    first_scheduled_time: float | None = None
    """`time.monotonic()` of the step that computed the request's first prompt chunk (queue wait ends)."""
    num_prefill_chunks: int = 0
    """Steps that computed part of the prompt (chunked prefill)."""
    finish_time: float | None = None
    text_pieces: list[str] = field(default_factory=list, repr=False)
    """The detokenized output as appended (`append_text`); `generated_text` joins it on read,
    so a token's text costs O(1), not a copy of all the text so far."""
    text_length: int = 0
    """Characters of `generated_text`."""
    num_preemptions: int = 0

    @property
    def generated_text(self) -> str:
        """The detokenized output so far."""
        if len(self.text_pieces) > 1:
            self.text_pieces[:] = ["".join(self.text_pieces)]
        return self.text_pieces[0] if self.text_pieces else ""

    @generated_text.setter
    def generated_text(self, text: str) -> None:
        self.text_pieces[:] = [text] if text else []
        self.text_length = len(text)

    def append_text(self, delta: str) -> None:
        if delta:
            self.text_pieces.append(delta)
            self.text_length += len(delta)
            if len(self.text_pieces) >= _MAX_TEXT_PIECES:  # amortised: a join every so many tokens
                self.text_pieces[:] = ["".join(self.text_pieces)]

    def text_tail(self, n: int) -> str:
        """The last `n` characters of `generated_text` (all of it if shorter), without joining the rest."""
        out: list[str] = []
        for piece in reversed(self.text_pieces):
            if n <= 0:
                break
            out.append(piece[-n:])
            n -= len(piece)
        return "".join(reversed(out))

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_tokens - 1 or not self.output_token_ids

    @property
    def wants_prompt_log_probs(self) -> bool:
        return self.params.return_log_probs and not self.params.skip_prompt_log_probs

    def output_so_far(self) -> list[int]:
        """Every token generated for this request: a resumed stream's earlier output (the
        prompt's last `params.output_offset` tokens), then its own (penalties count both)."""
        earlier = self.params.output_offset
        return self.prompt_token_ids[len(self.prompt_token_ids) - earlier :] + self.output_token_ids if earlier else \
            self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without building the whole list (hot path:
        called per request per step, where the full list would cost O(context))."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def extend_block_hashes(self, block_size: int) -> None:
        """Hash every full block of `all_token_ids` not hashed yet."""
        start = len(self.block_hashes) * block_size
        end = self.num_tokens // block_size * block_size
        if end > start:
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.extend(hash_blocks(self.token_slice(start, end), block_size, parent))


@dataclass(frozen=True)
class RequestTiming:
    """When a request moved through the engine (`time.monotonic()` seconds), for traces and metrics."""

    arrival: float
    first_scheduled: float | None
    first_token: float | None
    num_prefill_chunks: int


@dataclass(frozen=True)
class GenerationResult:
    """What `LLM.generate` returns for one prompt (fields of the reference design)."""

    request_id: str
    generated_text: str
    generated_tokens: list[int]
    prompt_length: int
    status: str
    prompt_tokens: list[int] | None = None
    generated_log_probs: list[float] | None = None
    prompt_log_probs: list[float] | None = None
    """One per prompt token after the first: its log-prob given the tokens before it."""
    prompt_top_logprobs: list[dict[int, float]] | None = None
    """With prompt log-probs and `top_n_logprobs`: each of those positions' top-N alternatives."""
    top_n_logprobs: list[dict[int, float]] | None = None
    ttft: float | None = None
    """Seconds from arrival to the first generated token."""
    num_cached_tokens: int = 0
    is_finished: bool = True
    timing: RequestTiming | None = None
    """Engine timestamps (queue wait, prefill compute); not part of the reference design's result."""

    @classmethod
    def from_request(cls, req: Request, is_finished: bool = True) -> GenerationResult:
        params = req.params
        return cls(
            request_id=req.request_id,
            generated_text=req.generated_text,
            generated_tokens=list(req.output_token_ids),
            prompt_length=req.prompt_len,
            status=req.status.value,
            prompt_tokens=list(req.prompt_token_ids) if params.return_prompt_tokens else None,
            generated_log_probs=list(req.generated_log_probs) if params.return_log_probs else None,
            prompt_log_probs=list(req.prompt_log_probs) if req.wants_prompt_log_probs else None,
            prompt_top_logprobs=(list(req.prompt_top_logprobs)
                                 if req.wants_prompt_log_probs and params.top_n_logprobs else None),
            top_n_logprobs=list(req.top_n_logprobs) if params.top_n_logprobs else None,
            ttft=None if req.first_token_time is None else req.first_token_time - req.arrival_time,
            num_cached_tokens=req.num_cached_tokens,
            is_finished=is_finished,
            timing=RequestTiming(req.arrival_time, req.first_scheduled_time, req.first_token_time, req.num_prefill_chunks),
        )
