"""The engine: `add_request` / `step` over scheduler → model runner → sampler → detokenizer.

    step():  schedule ─▶ runner.launch ─▶ prefix-cache registration ─▶ runner.collect
             ─▶ append tokens, stop checks ─▶ outputs, frees / handoff pins

With async scheduling (step_pipeline.py) a decode step stays in flight while the
next one is scheduled and launched; `step` then returns the tokens of the step
before.

Roles (see `EngineConfig.role`): an aggregated engine runs requests to the end;
a prefill engine stops each request after its first token and keeps its blocks
pinned until `release_handoff` (or the lease runs out); a decode engine also
accepts requests whose prompt KV is imported (`add_imported_request`).

Single-threaded: callers serialise access (the async front end runs every call
on one executor thread).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from splitserve.engine import step_pipeline as pipeline
from splitserve.engine.block_pool import BlockPool
from splitserve.engine.config import EngineConfig
from splitserve.engine.guided import Guides
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.models.config import ModelConfig
from splitserve.engine.parallel import ParallelState, init_parallel_state
from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import Scheduler
from splitserve.engine.step_outputs import StepOutput, apply_results
from splitserve.engine.stop import StopChecker
from splitserve.engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class PinnedHandoff:
    """A prefill request's blocks, held for a decode peer until released."""

    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token_id: int
    first_token_logprob: float | None
    lease_deadline: float
    """`time.monotonic()` after which the pins are dropped even without an ack."""


class Engine:
    def __init__(self, config: EngineConfig, parallel_state: ParallelState | None = None, seed: int = 0):
        self.config = config
        self.model_config = ModelConfig.from_checkpoint(config.model)
        self.tokenizer = _maybe_tokenizer(config.model)
        self.ps = parallel_state or init_parallel_state(config.parallel)
        self.runner = ModelRunner(config, self.model_config, self.ps, seed=seed)
        cache = config.cache
        self.block_size = cache.block_size_tokens
        self.pool = BlockPool(self.runner.num_blocks, cache.prefix_caching_eviction_policy, cache.enable_prefix_caching)
        self.pool.record_events = False  # a worker's KV-event publisher turns this on
        self.scheduler = Scheduler(config.scheduler, self.pool, self.block_size)
        if self.runner.states is not None:  # hybrid: a prefix hit needs a cached recurrent state too
            self.scheduler.prefix_limit = self.runner.states.usable_prefix_blocks
        limit = config.scheduler.max_sequence_length or self.model_config.max_position_embeddings
        self.max_sequence_length = min(limit, self.model_config.max_position_embeddings)
        self.eos_token_ids = self._eos_ids()
        self.guides = Guides(config.model if self.tokenizer is not None else None, self.model_config.vocab_size,
                             self.eos_token_ids)  # fmt: skip
        self._requests: dict[str, Request] = {}
        self._stops: dict[str, StopChecker] = {}
        self.handoffs: dict[str, PinnedHandoff] = {}
        self.reserved: dict[str, tuple[list[int], int]] = {}
        """Decode role: blocks held for a layer-wise prefetch (engine/prefetch.py), by request id:
        (block table, prefix-cache hits), until `add_imported_request(reserved=True)` or `unreserve`."""
        self.model_path = config.model
        """Checkpoint the weights came from (changes on a lifecycle reload)."""
        self.is_suspended = False
        self.snapshot_outputs = True
        """Attach a full result snapshot to every step output (streaming consumers that want
        whole results); when False only finished requests and first tokens get one, and
        consumers read each step's additions from the `StepOutput` (batch `generate`, decode
        workers' streams: saves O(tokens) copies per request per step on the hot path)."""
        self.num_pinned_blocks = 0
        """Blocks held by handoff pins (an int, safe to read from other threads)."""
        self._ids = itertools.count()
        self.async_scheduling = (
            config.async_scheduling if config.async_scheduling is not None else self.runner.graphs is not None
        )
        """Keep a decode step in flight while the next is scheduled (`step_pipeline.py`)."""
        if self.runner.states is not None:
            # Hybrid: the recurrent state is cached under block hashes of the tokens a step
            # processes, which must be real tokens, not the placeholders of a step run ahead.
            self.async_scheduling = False
        self._inflight: pipeline.Inflight | None = None
        self._ready: list[StepOutput] = []

    # ---------------------------------------------------------------- inputs
    def next_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Raise ValueError for input the engine cannot serve; return max new tokens."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        # Plain ints within range (the common case) are checked at C speed; the listing is for the error.
        is_plain = set(map(type, prompt_token_ids)) == {int}
        if not is_plain or min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            bad = [t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
            if bad:  # (an int subclass within range other than bool is still accepted)
                raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        prompt_len = len(prompt_token_ids)
        if prompt_len >= self.max_sequence_length:
            raise ValueError(
                f"prompt has {prompt_len} tokens; the limit is {self.max_sequence_length - 1} "
                f"(max_sequence_length {self.max_sequence_length} leaves room for one new token)"
            )
        max_new = params.max_new_tokens(prompt_len)
        if max_new < 1:
            raise ValueError(f"num_tokens_total={params.num_tokens_total} leaves no room after a {prompt_len}-token prompt")
        max_new = min(max_new, self.max_sequence_length - prompt_len)
        needed = -(-(prompt_len + max_new) // self.block_size)
        if needed > self.pool.num_blocks:
            raise ValueError(
                f"prompt + {max_new} new tokens need {needed} KV blocks; the cache has {self.pool.num_blocks}"
            )
        if params.termination_id is not None and params.termination_id >= vocab:
            raise ValueError(f"termination_id {params.termination_id} is outside the vocabulary [0, {vocab})")
        if params.logit_bias and params.logit_bias[-1][0] >= vocab:  # sorted: the last id is the largest
            raise ValueError(f"logit_bias token id {params.logit_bias[-1][0]} is outside the vocabulary [0, {vocab})")
        return max_new

    def _new_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if request_id in self.handoffs:  # one handoff per id: a second would orphan the first's pins
            raise ValueError(f"request id {request_id!r} holds a pinned handoff; release it first")
        max_new = self.validate(prompt_token_ids, params)
        eos = (params.termination_id,) if params.termination_id is not None else self.eos_token_ids
        req = Request(request_id, list(prompt_token_ids), params, () if params.ignore_eos else eos, max_new)
        if params.is_guided:  # (ValueError for a schema it cannot compile: before anything is held)
            req.guide = self.guides.matcher(params, req.output_so_far())
        self._requests[request_id] = req
        self._stops[request_id] = StopChecker(req, self.tokenizer)
        return req

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.scheduler.add(self._new_request(request_id, prompt_token_ids, params))

    def add_imported_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        first_token_id: int,
        first_token_logprob: float | None,
        import_kv: Callable[[list[int], int], None],
        reserved: bool = False,
    ) -> int:
        """Decode role: admit a request whose prompt KV comes from a prefill peer.

        `import_kv(block_ids, first_block)` fills blocks `first_block:` of the
        new block table in `self.kv_caches`; blocks before that were found in our
        own prefix cache. Returns the number of blocks reused from the cache.
        `reserved`: import into the blocks `reserve_import_blocks` held for this request.
        """
        # A step in flight may still write a dropped row's KV into blocks freed a step
        # early (step_pipeline.py); a transport writes outside the device stream's order,
        # so let that step finish before blocks are handed to an import.
        self.flush()
        held = self.reserved.pop(request_id) if reserved else None
        try:
            req = self._new_request(request_id, prompt_token_ids, params)
        except BaseException:
            if held is not None:
                self.pool.free(reversed(held[0]))
            raise
        try:
            self.scheduler.add_imported(req, first_token_id, import_kv, held)
        except BaseException:
            self._forget(request_id)
            raise
        req.first_token_time = time.monotonic()
        if req.guide is not None:
            req.guide.consume_token(first_token_id)
        if params.return_log_probs and first_token_logprob is not None:
            req.generated_log_probs.append(first_token_logprob)
        reused = req.num_cached_tokens // self.block_size
        _, status = self._stops[request_id].on_token(first_token_id)
        if status is not None:  # the first token already ends it (e.g. a one-token limit)
            self._finish(req, status, first_token_logprob)
        return reused

    def reserve_import_blocks(self, request_id: str, prompt_token_ids: list[int]) -> tuple[list[int], int]:
        """Decode role: hold the blocks a handoff of this prompt will be imported into (prefix-cache
        hits, then fresh blocks) before the handoff is complete; returns (block table, hits).
        Raises NoFreeBlocksError, or ValueError for an id already holding blocks."""
        if request_id in self.reserved:
            raise ValueError(f"request {request_id!r} already holds reserved blocks")
        self.flush()  # as add_imported_request: no step in flight may write the blocks handed out
        probe = Request(request_id, list(prompt_token_ids), SamplingParams(), (), 1)  # for its block hashes
        held = self.scheduler.reserve_import(probe)
        self.reserved[request_id] = held
        return held

    def unreserve(self, request_id: str) -> bool:
        """Give back blocks `reserve_import_blocks` held (the prefetch was dropped)."""
        held = self.reserved.pop(request_id, None)
        if held is not None:
            self.pool.free(reversed(held[0]))
        return held is not None

    @property
    def kv_caches(self) -> tuple[torch.Tensor, ...]:
        return self.runner.kv_caches

    # ------------------------------------------------------------------ step
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[StepOutput]:
        """Run one step; return what requests produced. With async scheduling
        (`step_pipeline.py`) a step returns the previous step's tokens while its
        own are still on the device."""
        if self.ps.world_size == 1:
            # On a rank group, clocks differ per rank: the group's driver decides
            # expiry and broadcasts releases (see `EngineLoop`), keeping ranks in step.
            self.release_expired_handoffs()
        outputs, self._ready = self._ready, []
        prev, self._inflight = self._inflight, None
        if prev is not None and not pipeline.same_requests(self, prev):
            outputs += self._apply(prev.out, self.runner.collect(prev.pending), ahead=True)
            prev = None
        out = self.scheduler.schedule()
        if out.is_empty:
            if prev is not None:  # cannot happen (prev's requests are running); never lose tokens
                outputs += self._apply(prev.out, self.runner.collect(prev.pending), ahead=True)
            return outputs
        self._note_scheduled(out)
        pending = self.runner.launch(out, feed=prev.pending if prev is not None else None)
        if prev is not None:  # step N+1 is queued: now wait for step N's tokens
            outputs += self._apply(prev.out, self.runner.collect(prev.pending), ahead=True)
        if pipeline.can_run_ahead(self, out, pending):
            pending = self.runner.settle_guided(pending)  # (step N-1 applied: the matchers are up to date)
            pipeline.advance(out)
            self._inflight = pipeline.Inflight(out, pending)
            return outputs
        for chunk in out.chunks:  # needs no sampled token: overlaps the device's step
            if not chunk.request.status.is_finished:
                self.scheduler.update_computed(chunk.request, chunk.start + chunk.num_tokens)
        return outputs + self._apply(out, self.runner.collect(pending), ahead=False)

    def flush(self) -> None:
        """Collect a step still in flight (its outputs come with the next `step`)."""
        prev, self._inflight = self._inflight, None
        if prev is not None:
            self._ready += self._apply(prev.out, self.runner.collect(prev.pending), ahead=True)

    def _note_scheduled(self, out) -> None:
        started = time.monotonic()
        for chunk in out.chunks:
            req = chunk.request
            if not req.output_token_ids:  # a prompt chunk: the request's queue wait ends here
                req.num_prefill_chunks += 1
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = started

    def _apply(self, out, results, ahead: bool) -> list[StepOutput]:
        return apply_results(self, out, results, ahead)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks. False if unknown."""
        released = self.release_handoff(request_id)
        req = self.scheduler.abort(request_id)
        if req is not None:
            req.finish_time = time.monotonic()
            self._forget(request_id)
        return released or req is not None

    def _finish(self, req: Request, status: RequestStatus, first_logprob: float | None) -> None:
        blocks = self.scheduler.finish(req, status)
        req.finish_time = time.monotonic()
        if status is RequestStatus.HANDOFF:
            self.handoffs[req.request_id] = PinnedHandoff(
                req.request_id,
                tuple(blocks),
                req.prompt_len,
                req.output_token_ids[0],
                first_logprob,
                time.monotonic() + self.config.cache.handoff_lease_s,
            )
            self.num_pinned_blocks += len(blocks)
            if self.runner.states is not None:  # the recurrent state travels with the KV
                self.runner.states.pin(req.request_id)
        self._forget(req.request_id)

    def _forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._stops.pop(request_id, None)
        self.runner.forget(request_id)

    # -------------------------------------------------------------- handoffs
    def release_handoff(self, request_id: str) -> bool:
        """Drop a handoff's pins (the decode side's ack, a cancel, or lease expiry)."""
        handoff = self.handoffs.pop(request_id, None)
        if handoff is None:
            return False
        self.pool.unpin(reversed(handoff.block_ids))
        self.num_pinned_blocks -= len(handoff.block_ids)
        if self.runner.states is not None:
            self.runner.states.unpin(request_id)
        return True

    def has_request(self, request_id: str) -> bool:
        """The request is waiting or running here (not finished, not handed off)."""
        return request_id in self._requests

    def expired_handoffs(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        return [r for r, h in self.handoffs.items() if h.lease_deadline <= now]

    def release_expired_handoffs(self) -> None:
        for request_id in self.expired_handoffs():
            self.release_handoff(request_id)

    # ------------------------------------------------------------ inspection
    def check_integrity(self) -> None:
        """Pool invariant plus: every in-use block is owned by a request or a pin."""
        self.flush()
        self.pool.check_integrity()
        owned: dict[int, int] = {}
        for req in self.scheduler.running:
            for b in req.block_ids:
                owned[b] = owned.get(b, 0) + 1
        for handoff in self.handoffs.values():
            for b in handoff.block_ids:
                owned[b] = owned.get(b, 0) + 1
        for block_ids, _ in self.reserved.values():
            for b in block_ids:
                owned[b] = owned.get(b, 0) + 1
        for b in range(self.pool.num_blocks):
            if self.pool.ref_count(b) != owned.get(b, 0):
                raise AssertionError(f"block {b}: ref count {self.pool.ref_count(b)} but {owned.get(b, 0)} owners")
        if self.runner.states is not None:
            states = self.runner.states.pool
            live = {r.request_id for r in self.scheduler.running} | {r.request_id for r in self.scheduler.waiting}
            states.check_integrity(live)
            if states.pinned != set(self.handoffs):
                raise AssertionError(f"state pins {sorted(states.pinned)} != handoffs {sorted(self.handoffs)}")

    def _eos_ids(self) -> tuple[int, ...]:
        ids = list(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return tuple(dict.fromkeys(ids))


def _maybe_tokenizer(path: str) -> Tokenizer | None:
    try:
        return Tokenizer(path)
    except FileNotFoundError:
        return None
