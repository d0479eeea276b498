"""High-level Python API (mirrors the reference design's `MegatronLLM`):

    from splitserve import LLM, SamplingParams
    llm = LLM()                                # the embedded default model
    [r] = llm.generate("def fib(n):", SamplingParams(num_tokens_to_generate=32, temperature=0))
    print(r.generated_text)

`generate` accepts a string, a list of strings, one list of token ids, or a list
of them, and always returns a list of results in input order. Every input is
validated before any is queued, so a bad prompt leaves nothing in the pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator, Sequence
from typing import Any

from splitserve.engine.config import (
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    TransferConfig,
)
from splitserve.engine.engine import Engine
from splitserve.engine.request import GenerationResult
from splitserve.engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]


def _default_model() -> str:
    from splitserve.engine.default_model import default_model_path

    return str(default_model_path())


def build_engine_config(model: str | None = None, **kwargs: Any) -> EngineConfig:
    """Route flat keyword arguments (`block_size_tokens=`, `max_tokens=`, ...) to their config."""
    groups: dict[type, dict[str, Any]] = {CacheConfig: {}, SchedulerConfig: {}, ParallelConfig: {}, TransferConfig: {}}
    top: dict[str, Any] = {}
    for key, value in kwargs.items():
        for cls, bucket in groups.items():
            if key in cls.__dataclass_fields__:
                bucket[key] = value
                break
        else:
            if key not in EngineConfig.__dataclass_fields__:
                raise TypeError(f"unknown engine option {key!r}")
            top[key] = value
    return EngineConfig(
        model=model or _default_model(),
        cache=CacheConfig(**groups[CacheConfig]),
        scheduler=SchedulerConfig(**groups[SchedulerConfig]),
        parallel=ParallelConfig(**groups[ParallelConfig]),
        transfer=TransferConfig(**groups[TransferConfig]),
        **top,
    )


class LLM:
    """Synchronous front end over one `Engine` (one process per rank for TP/PP)."""

    def __init__(self, model: str | None = None, *, seed: int = 0, **engine_options: Any):
        self.engine = Engine(build_engine_config(model, **engine_options), seed=seed)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def encode(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.engine.tokenizer is None:
                raise ValueError("this model has no tokenizer.json; pass token ids instead of text")
            return self.engine.tokenizer.encode(prompt, add_bos=params.add_BOS)
        if isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def _normalise(self, prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, Sequence) and prompts and all(isinstance(p, int) for p in prompts):
            return [prompts]
        if isinstance(prompts, Sequence) and not isinstance(prompts, bytes):
            if not prompts:
                raise ValueError("no prompts given")
            return list(prompts)
        raise ValueError(f"prompts must be a string, token ids or a list of them, got {type(prompts).__name__}")

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | None = None
    ) -> list[GenerationResult]:
        params = SamplingParams.coerce(sampling_params or SamplingParams())
        batch = [self.encode(p, params) for p in self._normalise(prompts)]
        for ids in batch:
            self.engine.validate(ids, params)
        request_ids = [self.engine.next_request_id() for _ in batch]
        results: dict[str, GenerationResult] = {}
        snapshot, self.engine.snapshot_outputs = self.engine.snapshot_outputs, False
        try:
            for request_id, ids in zip(request_ids, batch, strict=True):
                self.engine.add_request(request_id, ids, params)
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.result is not None and out.result.is_finished:
                        results[out.request_id] = out.result
        except BaseException:
            for request_id in request_ids:
                self.engine.abort(request_id)
            raise
        finally:
            self.engine.snapshot_outputs = snapshot
        return [results[r] for r in request_ids]


class AsyncLLM:
    """asyncio front end: one background loop steps the engine on a dedicated
    thread while callers await results or stream partial ones."""

    def __init__(self, model: str | None = None, *, seed: int = 0, **engine_options: Any):
        self._sync = LLM(model, seed=seed, **engine_options)
        self.engine = self._sync.engine
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop_task: asyncio.Task | None = None
        self._wakeup = asyncio.Event()

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            if not self.engine.has_unfinished():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                outputs = await self._call(self.engine.step)
            except Exception as exc:  # deliver the failure to every waiter instead of hanging them
                for queue in self._queues.values():
                    queue.put_nowait(exc)
                self._queues.clear()
                raise
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out.result)

    async def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> AsyncIterator[GenerationResult]:
        """Yield a result snapshot after every new token; the last has `is_finished`."""
        params = SamplingParams.coerce(sampling_params or SamplingParams())
        ids = self._sync.encode(prompt, params)
        request_id = self.engine.next_request_id()
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        try:
            await self._call(self.engine.add_request, request_id, ids, params)
            self._ensure_loop()
            self._wakeup.set()
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.is_finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            # A no-op for a finished request; stops the work of an abandoned stream.
            await self._call(self.engine.abort, request_id)

    async def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | None = None
    ) -> list[GenerationResult]:
        params = SamplingParams.coerce(sampling_params or SamplingParams())
        normalised = self._sync._normalise(prompts)
        for p in normalised:  # validate all before queueing any
            self.engine.validate(self._sync.encode(p, params), params)

        async def last(p: Prompt) -> GenerationResult:
            final = None
            async for partial in self.stream(p, params):
                final = partial
            return final

        return list(await asyncio.gather(*(last(p) for p in normalised)))

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._executor.shutdown(wait=False)
