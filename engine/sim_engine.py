"""`SimEngine` (`--engine sim`): a worker engine that runs no model, so the control
plane and the router can be exercised with 100+ workers on a CPU machine.

    real Engine                               SimEngine
    ───────────                               ─────────
    Scheduler + BlockPool (prefix cache)      the same classes, the same state
    request lifecycle (stops, pins, leases)   the same code (Engine's own functions)
    ModelRunner: forward + sample             SimRunner: sleep the modelled step time,
                                                         pseudo-token = H(context) mod vocab
    KV tensors, NIXL / in-proc pulls          none; an import sleeps bytes / transfer_gbps

Timing model of one step: `prefill_tokens / prefill_tokens_per_s` plus
`decode_step_s` if the step decodes anything (decode is memory-bound, so its
cost hardly depends on the batch). A token is a hash of the whole context
(prompt + tokens so far), so it depends on nothing else: a request gives the
same tokens on any worker, aggregated or handed off, with or without cache hits.
Log-probs are hashes too (multiples of 1/1024, exact in float32). There is no
EOS (requests end on their length or termination id) and no tokenizer (no text,
so stop words are refused).

The shape of the simulated model — for KV block sizing, the handoff layout and
the modelled transfer bytes — comes from `--model`'s config.json (no weights
are read) or, without one, `SIM_MODEL` (a Llama-3-8B shape).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from splitserve.engine.block_pool import BlockPool
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine, PinnedHandoff
from splitserve.engine.guided import Guides
from splitserve.engine.handoff import HandoffDescriptor, HandoffStage, engine_layout
from splitserve.engine.kv_cache import num_blocks_for
from splitserve.engine.models.config import ModelConfig
from splitserve.engine.parallel import ParallelState
from splitserve.engine.request import Request
from splitserve.engine.sampler import SampleResult
from splitserve.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from splitserve.engine.step_sampling import ChunkResult
from splitserve.engine.stop import StopChecker
from splitserve.engine.transfer.plan import TransferPlan, build_plan
from splitserve.engine.transfer.transport import KVTransport, TransferError, TransferStats, TransferTimeout

SIM_MODEL = ModelConfig(
    family="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
    head_dim=128, intermediate_size=14336, rms_norm_eps=1e-5, max_position_embeddings=8192,
    tie_word_embeddings=False, qkv_bias=False, rope_theta=500000.0, torch_dtype="bfloat16", name="sim-llama-8b",
)  # fmt: skip
"""The simulated model's shape when no --model is given (Llama-3-8B: 2 MiB of KV per 16-token block)."""

_KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class SimConfig:
    """Timing and vocabulary of a simulated engine (flags `--sim-*`)."""

    prefill_tokens_per_s: float = 20_000.0
    """Modelled prefill throughput: a step's prefill tokens take `tokens / prefill_tokens_per_s` seconds."""
    decode_step_s: float = 0.02
    """Modelled time a step spends decoding (one token for every decoding request), whatever the batch."""
    transfer_gbps: float = 10.0
    """Modelled KV pull bandwidth, GB/s (decode role): importing a handoff sleeps `bytes / (transfer_gbps * 1e9)`."""
    vocab_size: int | None = None
    """Pseudo-tokens lie in [0, vocab_size); None = the model's vocabulary. Prompts are checked against it too."""

    def __post_init__(self) -> None:
        _positive("prefill_tokens_per_s", self.prefill_tokens_per_s)
        _positive("transfer_gbps", self.transfer_gbps)
        if (
            isinstance(self.decode_step_s, bool)
            or not isinstance(self.decode_step_s, int | float)
            or self.decode_step_s < 0
        ):
            raise ValueError(f"decode_step_s must be a number >= 0, got {self.decode_step_s!r}")
        if self.vocab_size is not None and (
            isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 2
        ):
            raise ValueError(f"vocab_size must be an integer >= 2 or None, got {self.vocab_size!r}")


# ---------------------------------------------------------------- the runner
@dataclass
class _Context:
    """The running hash of one request's token ids (fed incrementally: O(new tokens) per step)."""

    request: Request
    hasher: Any
    num_fed: int = 0

    def digest(self) -> bytes:
        req = self.request
        prompt_len = req.prompt_len
        if self.num_fed < prompt_len:
            self.hasher.update(_pack(req.prompt_token_ids[self.num_fed :]))
            self.num_fed = prompt_len
        outputs = req.output_token_ids[self.num_fed - prompt_len :]
        if outputs:
            self.hasher.update(_pack(outputs))
            self.num_fed += len(outputs)
        return self.hasher.copy().digest()


def _pack(token_ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def _is_decode(chunk: ScheduledChunk) -> bool:
    """A chunk computing one generated token's KV (not a prompt chunk or a recompute)."""
    return chunk.num_tokens == 1 and chunk.start >= chunk.request.prompt_len


class SimRunner:
    """Stands in for `ModelRunner`: no weights and no KV tensors. `execute` returns
    pseudo-tokens and then sleeps until the step's modelled duration has passed."""

    def __init__(
        self,
        sim: SimConfig,
        vocab_size: int,
        dtype: torch.dtype,
        num_blocks: int,
        sleep: Callable[[float], None],
    ):
        self.sim = sim
        self.vocab_size = vocab_size
        self.dtype = dtype
        """KV dtype the simulated cache would have (`engine_layout` reads it)."""
        self.num_blocks = num_blocks
        self.kv_caches: tuple[torch.Tensor, ...] = ()
        self.graphs = None
        """No CUDA graphs to reset (engine/lifecycle.py asks)."""
        self.states = None
        """No recurrent state (hybrid models are served as their KV shape only)."""
        self.sleep = sleep
        self.num_steps = 0
        self.busy_s = 0.0
        """Modelled seconds of all steps so far."""
        self._contexts: dict[str, _Context] = {}

    def step_seconds(self, out: SchedulerOutput) -> float:
        num_prefill = sum(c.num_tokens for c in out.chunks if not _is_decode(c))
        decoding = any(_is_decode(c) for c in out.chunks)
        return num_prefill / self.sim.prefill_tokens_per_s + (self.sim.decode_step_s if decoding else 0.0)

    def launch(self, out: SchedulerOutput, feed=None) -> SchedulerOutput:
        """The real runner's launch/collect pair (engine.py); nothing runs ahead here."""
        return out

    def collect(self, out: SchedulerOutput) -> list[ChunkResult]:
        return self.execute(out)

    def execute(self, out: SchedulerOutput) -> list[ChunkResult]:
        start = time.monotonic()
        seconds = self.step_seconds(out)
        results = [self._chunk_result(chunk) for chunk in out.chunks]
        self.num_steps += 1
        self.busy_s += seconds
        remaining = start + seconds - time.monotonic()  # hashing time counts towards the step
        if remaining > 0:
            self.sleep(remaining)
        return results

    def _chunk_result(self, chunk: ScheduledChunk) -> ChunkResult:
        req = chunk.request
        sample = self._sample(req) if chunk.is_sample else None
        prompt_log_probs: tuple[float, ...] = ()
        tops: tuple[dict[int, float], ...] = ()
        if req.wants_prompt_log_probs and chunk.start < req.prompt_len:
            end = min(chunk.start + chunk.num_tokens + 1, req.prompt_len)
            targets = req.prompt_token_ids[chunk.start + 1 : end]
            prompt_log_probs = tuple(-((t * 2654435761) % 8192) / 1024 for t in targets)
            if req.params.top_n_logprobs:  # the prompt token itself as the only alternative
                tops = tuple({t: lp} for t, lp in zip(targets, prompt_log_probs, strict=True))
        return ChunkResult(req.request_id, sample, prompt_log_probs, tops)

    def _sample(self, req: Request) -> SampleResult:
        ctx = self._contexts.get(req.request_id)
        if ctx is None or ctx.request is not req:
            ctx = self._contexts[req.request_id] = _Context(
                req, hashlib.blake2b(digest_size=16, person=b"splitserve-sim")
            )
        digest = ctx.digest()
        token = int.from_bytes(digest[:8], "little") % self.vocab_size
        logprob = -(int.from_bytes(digest[8:], "little") % 8192) / 1024
        top_n = None
        if req.params.top_n_logprobs:
            n = min(req.params.top_n_logprobs, self.vocab_size)
            top_n = {(token + i) % self.vocab_size: logprob - i for i in range(n)}
        return SampleResult(token, logprob, top_n)

    def forget(self, request_id: str) -> None:
        self._contexts.pop(request_id, None)


# ---------------------------------------------------------------- the engine
class SimEngine:
    """Duck-types `Engine` for the worker code (`EngineLoop`, hooks, services, handoff).

    Only the runner is simulated: the request lifecycle — validation, admission,
    stop checks, handoff pins and leases, aborts, the integrity check — is the
    real engine's code (the functions below are `Engine`'s own), so prefix hits,
    pins and KV events behave exactly as on a real worker. One rank only.
    """

    is_simulated = True
    """Lets shared code (engine/handoff.py) pick the simulated path."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig = SIM_MODEL,
        sim: SimConfig | None = None,
        *,
        sleep: Callable[[float], None] = time.sleep,
    ):
        """`model_config` is the simulated shape; `sleep` can be replaced to run without waiting (tests)."""
        self.sim = sim or SimConfig()
        if config.parallel.world_size != 1:
            raise ValueError(
                f"the sim engine runs one rank; got tensor_parallel_size={config.parallel.tensor_parallel_size} "
                f"x pipeline_parallel_size={config.parallel.pipeline_parallel_size}"
            )
        if self.sim.vocab_size is not None:
            model_config = dataclasses.replace(model_config, vocab_size=self.sim.vocab_size)
        self.config = config
        self.model_config = model_config
        self.model_path = config.model
        self.tokenizer = None
        self.ps = ParallelState()
        dtype_name = model_config.torch_dtype if config.dtype == "auto" else config.dtype
        dtype = _KV_DTYPES.get(dtype_name, torch.bfloat16)  # as on a GPU, not the real engine's CPU float32
        num_blocks = num_blocks_for(model_config, self.ps, config.cache, dtype)
        self.runner = SimRunner(self.sim, model_config.vocab_size, dtype, num_blocks, sleep)
        cache = config.cache
        self.block_size = cache.block_size_tokens
        self.pool = BlockPool(num_blocks, cache.prefix_caching_eviction_policy, cache.enable_prefix_caching)
        self.pool.record_events = False  # a worker's KV-event publisher turns this on
        self.scheduler = Scheduler(config.scheduler, self.pool, self.block_size)
        limit = config.scheduler.max_sequence_length or model_config.max_position_embeddings
        self.max_sequence_length = min(limit, model_config.max_position_embeddings)
        self.eos_token_ids: tuple[int, ...] = ()
        self.guides = Guides(None, model_config.vocab_size, ())  # pseudo-tokens: a json_schema is refused
        self._requests: dict[str, Request] = {}
        self._stops: dict[str, StopChecker] = {}
        self.handoffs: dict[str, PinnedHandoff] = {}
        self.reserved: dict[str, tuple[list[int], int]] = {}  # never filled: no prefetch without KV
        self.is_suspended = False
        self.snapshot_outputs = True
        self.num_pinned_blocks = 0
        """Blocks held by handoff pins (an int, safe to read from other threads)."""
        self._ids = itertools.count()
        self.async_scheduling = False  # no device to overlap with
        self._inflight = None
        self._ready: list = []
        self.fingerprint = "sim-" + hashlib.sha256(repr(model_config).encode()).hexdigest()[:28]
        """Model identity in handoff descriptors: equal for sim engines of one shape and vocabulary,
        never equal to a real engine's `model_fingerprint`, so a real decode worker refuses our handoffs."""

    @property
    def kv_caches(self) -> tuple[torch.Tensor, ...]:
        return self.runner.kv_caches  # always empty: there is no KV memory

    # The real engine's request lifecycle, verbatim (see the class docstring).
    next_request_id = Engine.next_request_id
    validate = Engine.validate
    _new_request = Engine._new_request
    add_request = Engine.add_request
    add_imported_request = Engine.add_imported_request
    has_unfinished = Engine.has_unfinished
    has_request = Engine.has_request
    step = Engine.step
    flush = Engine.flush
    _note_scheduled = Engine._note_scheduled
    _apply = Engine._apply
    abort = Engine.abort
    _finish = Engine._finish
    _forget = Engine._forget
    release_handoff = Engine.release_handoff
    expired_handoffs = Engine.expired_handoffs
    release_expired_handoffs = Engine.release_expired_handoffs
    check_integrity = Engine.check_integrity
    reserve_import_blocks = Engine.reserve_import_blocks
    unreserve = Engine.unreserve


def build_sim_engine(
    model: str | None, role: str, sim: SimConfig, engine_options: Mapping[str, Any], *, seed: int = 0
) -> SimEngine:
    """A SimEngine for a worker: `model` is a checkpoint directory whose config.json gives
    the shape (weights are never read), or None for `SIM_MODEL`. `seed` is unused:
    pseudo-tokens depend on the context only."""
    from splitserve.engine.llm import build_engine_config

    model_config = ModelConfig.from_checkpoint(model) if model else SIM_MODEL
    config = build_engine_config(model or SIM_MODEL.name, role=role, **engine_options)
    return SimEngine(config, model_config, sim)


# ---------------------------------------------------------------- the handoff
class SimTransport(KVTransport):
    """The KV transport of a sim worker: there is no KV memory to expose or read.
    Imports are modelled by `make_sim_importer`, which never calls `pull`."""

    def expose(self, kv_tensors: Sequence[torch.Tensor]) -> bytes:
        return b"sim"

    def pull(
        self,
        plan: TransferPlan,
        dst_rank: int,
        remote: Mapping[int, bytes],
        kv_tensors: Sequence[torch.Tensor],
        timeout_s: float = 30.0,
    ) -> TransferStats:
        raise TransferError("the sim transport moves no data (a simulated engine models its imports)")

    def close(self) -> None:
        pass


def make_sim_importer(
    engine: SimEngine, desc: HandoffDescriptor, timeout_s: float = 30.0, stats_out: list | None = None
) -> Callable[[list[int], int], None]:
    """`import_kv` for a simulated decode engine: the real importer's checks (same
    model, a plan between the two layouts) and its duration, without the data.
    The checksums (zeros: no KV) are not verified; nothing was moved to verify."""

    def import_kv(block_ids: list[int], first_block: int) -> None:
        if desc.model_fingerprint != engine.fingerprint:
            raise TransferError("handoff comes from a different model (fingerprint mismatch)")
        try:
            plan = build_plan(desc.layout, engine_layout(engine), desc.rank_block_ids, {0: block_ids}, first_block)
        except Exception as exc:  # as the real importer reports it
            raise TransferError(f"handoff {desc.request_id}: {HandoffStage.PLANNING.value} failed: {exc}") from exc
        seconds = plan.bytes_total / (engine.sim.transfer_gbps * 1e9)
        if seconds > timeout_s:
            engine.runner.sleep(timeout_s)
            raise TransferTimeout(
                f"handoff {desc.request_id}: {HandoffStage.TRANSFERRING.value} failed: modelled pull of "
                f"{plan.bytes_total} bytes takes {seconds:.3f} s > {timeout_s} s"
            )
        engine.runner.sleep(seconds)
        if stats_out is not None:
            stats_out.append(TransferStats(plan.bytes_total, seconds, len(plan.ops)))

    return import_kv
