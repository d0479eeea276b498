"""Continuous batching with chunked prefill and decode piggybacking.

Each `schedule()` fills one forward step under a token budget (`max_tokens`):

    1. every running request that is decoding gets its one token first,
       preempting (recompute-style) the most recently admitted request when
       the pool has no block for it — so running decodes never stall;
    2. what is left of the budget goes to prefill chunks: first requests that
       are part-way through their prompt, then waiting requests in arrival
       order, each starting after its longest cached prefix.

The scheduler owns request state and block tables; the engine owns the model
and sampling and reports back through `update_computed` / `finish`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.engine.block_pool import BlockPool, NoFreeBlocksError
from splitserve.engine.config import SchedulerConfig
from splitserve.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute `request.all_token_ids[start : start + num_tokens]` this step."""

    request: Request
    start: int
    num_tokens: int
    is_sample: bool
    """The chunk reaches the last known token, so the step samples the next one."""


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    preempted_ids: tuple[str, ...]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, block_size: int):
        self.config = config
        self.pool = pool
        self.block_size = block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefix_limit: Callable[[list], int] | None = None
        """Hybrid models: `prefix_limit(hit_block_hashes)` -> how many of the KV prefix-hit
        blocks may be used (up to the deepest block boundary with a cached recurrent state)."""

    # ------------------------------------------------------------- admission
    def add(self, req: Request) -> None:
        req.extend_block_hashes(self.block_size)
        self.waiting.append(req)

    def reserve_import(self, req: Request) -> tuple[list[int], int]:
        """Blocks to import `req`'s prompt into: its prefix-cache hits (referenced) followed by
        fresh ones, and the number of hits. Raises NoFreeBlocksError; the caller owns the blocks."""
        req.extend_block_hashes(self.block_size)
        hits = self.pool.lookup(req.block_hashes[: req.prompt_len // self.block_size])
        num_new = self._blocks_for(req.prompt_len) - len(hits)
        if not self.pool.can_allocate(num_new):
            raise NoFreeBlocksError(f"need {num_new} KV blocks to import, {self.pool.num_available} available")
        self.pool.ref(hits)
        return hits + self.pool.allocate(num_new), len(hits)

    def add_imported(
        self, req: Request, first_token_id: int, import_kv: Callable[[list[int], int], None],
        reserved: tuple[list[int], int] | None = None,
    ) -> None:  # fmt: skip
        """Admit a request whose prompt KV arrives from a prefill peer (decode role).

        Blocks already in our prefix cache are reused; `import_kv(block_ids,
        first_block)` must fill blocks `first_block:` of the new table. `reserved`
        (from `reserve_import`, owned from here on) replaces the lookup and allocation.
        On any failure the blocks are given back and the error propagates.
        """
        if len(self.running) >= self.config.max_requests:
            if reserved is not None:
                self.pool.free(reversed(reserved[0]))
            raise NoFreeBlocksError(f"decode engine is full ({self.config.max_requests} requests running)")
        if reserved is None:
            reserved = self.reserve_import(req)
        else:
            req.extend_block_hashes(self.block_size)
        req.block_ids, num_hits = list(reserved[0]), reserved[1]
        try:
            import_kv(req.block_ids, num_hits)
        except BaseException:
            self.pool.free(reversed(req.block_ids))
            req.block_ids = []
            raise
        req.num_cached_tokens = num_hits * self.block_size
        req.num_registered_blocks = num_hits
        req.output_token_ids.append(first_token_id)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.update_computed(req, req.prompt_len)

    def abort(self, request_id: str) -> Request | None:
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                req.status = RequestStatus.FINISHED_ABORTED
                return req
        for req in self.running:
            if req.request_id == request_id:
                self.finish(req, RequestStatus.FINISHED_ABORTED)
                return req
        return None

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        scheduled: set[str] = set()

        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING or req.num_tokens - req.num_computed_tokens != 1:
                continue
            if budget < 1:
                break
            while not self._grow(req, req.num_tokens):
                victim = next((r for r in reversed(self.running) if r.request_id not in scheduled), None)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            chunks.append(ScheduledChunk(req, req.num_computed_tokens, 1, True))
            scheduled.add(req.request_id)
            budget -= 1

        for req in self.running:
            if req.request_id in scheduled or budget < 1:
                continue
            chunk = self._prefill_chunk(req, budget, has_other_work=bool(chunks))
            if chunk is None:
                break
            chunks.append(chunk)
            budget -= chunk.num_tokens

        while self.waiting and budget > 0 and len(self.running) < self.config.max_requests:
            req = self.waiting[0]
            hits = self._cache_hits(req) if not req.block_ids else []
            self.pool.ref(hits)
            req.block_ids = list(hits)
            req.num_computed_tokens = len(hits) * self.block_size
            req.num_registered_blocks = len(hits)
            chunk = self._prefill_chunk(req, budget, has_other_work=bool(chunks))
            if chunk is None:
                self.pool.free(reversed(req.block_ids))
                req.block_ids, req.num_computed_tokens, req.num_registered_blocks = [], 0, 0
                break
            if not req.output_token_ids:
                req.num_cached_tokens = req.num_computed_tokens
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(chunk)
            budget -= chunk.num_tokens
        return SchedulerOutput(tuple(chunks), tuple(preempted))

    def _prefill_chunk(self, req: Request, budget: int, has_other_work: bool) -> ScheduledChunk | None:
        remaining = req.num_tokens - req.num_computed_tokens
        if self.config.enable_chunked_prefill:
            num = min(remaining, budget)
        elif remaining <= budget or not has_other_work:
            num = remaining  # whole prompt; alone in its step it may exceed the budget
        else:
            return None
        if not self._grow(req, req.num_computed_tokens + num):
            return None
        start = req.num_computed_tokens
        return ScheduledChunk(req, start, num, start + num == req.num_tokens)

    def _cache_hits(self, req: Request) -> list[int]:
        if req.wants_prompt_log_probs:
            return []  # prompt log-probs need logits at every position
        # Leave at least one token to compute: its logits give the next token.
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits = self.pool.lookup(req.block_hashes[:max_blocks])
        if self.prefix_limit is not None and hits:
            hits = hits[: self.prefix_limit(req.block_hashes[: len(hits)])]
        self.pool.num_queries += max_blocks
        self.pool.num_hits += len(hits)
        return hits

    def _blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Make `req`'s table hold `num_tokens` tokens; False if the pool is short."""
        missing = self._blocks_for(num_tokens) - len(req.block_ids)
        if missing <= 0:
            return True
        if not self.pool.can_allocate(missing):
            return False
        req.block_ids.extend(self.pool.allocate(missing))
        return True

    def preempt_all(self) -> None:
        """Requeue every running request (their KV is about to go away)."""
        for req in reversed(list(self.running)):
            self._preempt(req)

    def _preempt(self, req: Request) -> None:
        """Recompute-style preemption: drop the KV, requeue at the front."""
        self.running.remove(req)
        self.pool.free(reversed(req.block_ids))
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    # ---------------------------------------------------------------- updates
    def update_computed(self, req: Request, num_computed_tokens: int) -> None:
        """Record computed KV and publish newly full blocks to the prefix cache."""
        req.num_computed_tokens = num_computed_tokens
        req.extend_block_hashes(self.block_size)
        num_full = min(num_computed_tokens // self.block_size, len(req.block_hashes))
        for index in range(req.num_registered_blocks, num_full):
            parent = req.block_hashes[index - 1] if index else None
            self.pool.register(req.block_ids[index], req.block_hashes[index], parent)
        req.num_registered_blocks = max(req.num_registered_blocks, num_full)

    def finish(self, req: Request, status: RequestStatus) -> list[int]:
        """Take `req` out of the running set. Its blocks are freed, except for a
        handoff, where the request's references become pins (returned)."""
        if req in self.running:
            self.running.remove(req)
        req.status = status
        blocks, req.block_ids = req.block_ids, []
        if status is RequestStatus.HANDOFF:
            self.pool.pin(blocks)
        self.pool.free(reversed(blocks))
        return blocks
