"""Engine configuration: one frozen dataclass per concern, composed in `EngineConfig`.

Every field is documented where it is defined and validated in `__post_init__`
with an error that quotes the bad value. Values discovered at run time (the
model's shape, the number of KV blocks that fit) live in separate objects
(`ModelConfig`, `CacheLayout`) — configs are never mutated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

EvictionPolicy = Literal["lru", "ref_zero"]
Role = Literal["aggregated", "prefill", "decode"]
LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]

_DTYPES = ("auto", "float32", "float16", "bfloat16")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")


def _positive(name: str, value: int | float | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache and prefix cache."""

    block_size_tokens: int = 16
    """Tokens per KV block (page). Prefix caching reuses whole blocks only."""
    buffer_size_gb: float = 0.25
    """Memory budget for the KV block pool, summed over this rank's layers."""
    num_blocks: int | None = None
    """Exact number of blocks; overrides `buffer_size_gb` (tests, benchmarks)."""
    enable_prefix_caching: bool = True
    """Reuse blocks whose chained hash matches across requests."""
    prefix_caching_eviction_policy: EvictionPolicy = "lru"
    """`lru`: unreferenced cached blocks stay until space is needed, oldest first.
    `ref_zero`: a cached block is dropped the moment its last reference goes."""
    handoff_lease_s: float = 30.0
    """Prefill role: pinned blocks are released after this many seconds even if
    the decode side never acknowledges — pins can never leak."""
    prefix_caching_mamba_gb: float = 0.0625
    """Hybrid models: memory budget (per rank, over its mamba layers) for recurrent
    states (conv + SSM) cached at block boundaries, so a prefix-cache hit can resume
    the recurrence there. A KV hit is only used up to the deepest block boundary
    whose state is cached. 0 turns state prefix caching (hence hybrid prefix hits) off."""
    mamba_state_slots: int | None = None
    """Hybrid models: recurrent-state slots (one per running request or pinned
    handoff); default 2 x `max_requests`."""
    mamba_state_dtype: str = "auto"
    """Dtype of the SSM state [H, P, N] per request: auto (float32, as NemotronH's
    `mamba_ssm_cache_dtype`), float32, float16 or bfloat16."""
    conv_state_dtype: str = "auto"
    """Dtype of the conv state [conv channels, K - 1] per request: auto (the model dtype),
    float32, float16 or bfloat16."""

    def __post_init__(self) -> None:
        _positive("block_size_tokens", self.block_size_tokens)
        if isinstance(self.prefix_caching_mamba_gb, bool) or not isinstance(self.prefix_caching_mamba_gb, int | float) \
                or self.prefix_caching_mamba_gb < 0:
            raise ValueError(f"prefix_caching_mamba_gb must be a number >= 0, got {self.prefix_caching_mamba_gb!r}")
        _positive("mamba_state_slots", self.mamba_state_slots, allow_none=True)
        for name in ("mamba_state_dtype", "conv_state_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"{name} must be one of {_DTYPES}, got {getattr(self, name)!r}")
        _positive("handoff_lease_s", self.handoff_lease_s)
        _positive("buffer_size_gb", self.buffer_size_gb)
        _positive("num_blocks", self.num_blocks, allow_none=True)
        if self.prefix_caching_eviction_policy not in ("lru", "ref_zero"):
            raise ValueError(
                "prefix_caching_eviction_policy must be 'lru' or 'ref_zero', "
                f"got {self.prefix_caching_eviction_policy!r}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_requests: int = 64
    """Requests running at once (decoding or prefilling)."""
    max_tokens: int = 2048
    """Token budget of one forward step (decode tokens + prefill chunk tokens)."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps so running decodes are never stalled.
    When off, a prompt is prefilled whole in one step (it may exceed `max_tokens`)."""
    max_sequence_length: int | None = None
    """Longest prompt + generation accepted; defaults to the model's context."""

    def __post_init__(self) -> None:
        _positive("max_requests", self.max_requests)
        _positive("max_tokens", self.max_tokens)
        _positive("max_sequence_length", self.max_sequence_length, allow_none=True)


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor and pipeline parallelism inside one worker group."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        _positive("pipeline_parallel_size", self.pipeline_parallel_size)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class TransferConfig:
    """KV handoff between a prefill and a decode worker (engine/handoff.py, engine/transfer/)."""

    layerwise: bool = True
    """Layer-wise streaming. Prefill role: when the step completing a prompt starts, publish a
    preview of its handoff (PrefillEvent.handoff_started) and mark each layer's readiness on the
    transport's progress board as the forward pass writes it (engine/handoff_layerwise.py).
    Decode role: take previews (DecodeWorker.Prefetch) and pull each layer as soon as it is
    written, on a background thread, summing its block checksums as it goes (engine/prefetch.py);
    a descriptor naming a slot without a prefetch is pulled layer by layer too. Needs a transport
    with a board (nixl, shm, inproc); torch_dist and cuda_ipc ignore it.

    On by default: `benchmarks/layerwise_served.py --split-cores` (prefill and decode on separate
    compute, which is what disaggregation deploys) measured decode ready 2-10% sooner, the import
    left after prefill 57 -> 2.5 ms and 293 -> 3.3 ms (shm), 309 -> 5.9 and 1133 -> 12.3 ms (nixl).
    When both pools share CPU cores the overlap takes compute from the prefill (0-4% later): turn it
    off there (`--no-layerwise`). The first token never waits for it (prefill streams it first)."""
    num_progress_slots: int = 64
    """Streamed handoffs one prefill rank can have in flight (rows of its progress board); a
    handoff beyond that is published without streaming."""
    pack_for_tp: int = 0
    """Prefill role, NIXL, one-rank prefill groups: > 0 turns on packed memory, and every
    handoff's head slices are packed as the layers are written (engine/handoff_pack.py) for the
    decode worker's TP size the router names with the request (`PrefillRequest.decode_tp`), or
    this TP size when it names none; a decode rank that takes part of the heads then reads
    contiguous memory instead of one small region per block (tp 1 -> 2 on CPU: 15-33% -> 57-97%
    of memcpy, benchmarks/RESULTS.md). The packed copies take up to a quarter of the KV pool's
    size; handoffs beyond that read the pool as before. 0 (default here): no packing. The worker
    CLI's default `auto` resolves it from the cluster's shard spec (`resolve_pack_for_tp`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.layerwise, bool):
            raise ValueError(f"layerwise must be a bool, got {self.layerwise!r}")
        _positive("num_progress_slots", self.num_progress_slots)
        if not isinstance(self.pack_for_tp, int) or isinstance(self.pack_for_tp, bool) or self.pack_for_tp < 0:
            raise ValueError(f"pack_for_tp must be an int >= 0 (0 = off), got {self.pack_for_tp!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs; composed from the per-concern configs."""

    model: str
    """Path of a Hugging Face checkpoint directory (config.json + *.safetensors)."""
    dtype: str = "auto"
    """Weights and KV dtype: auto (the checkpoint's, fp32 on CPU for fp16/bf16
    checkpoints would change numerics, so auto keeps the stored dtype), float32,
    float16 or bfloat16."""
    device: str = "auto"
    """`auto` picks CUDA when present, else CPU (`SPLITSERVE_AUTO_DEVICE=cpu|cuda` overrides that choice)."""
    role: Role = "aggregated"
    """aggregated: whole requests. prefill: stop after the first token and keep
    the request's blocks pinned for a handoff. decode: accept imported KV."""
    logprobs_mode: LogprobsMode = "raw_logprobs"
    """raw: log-softmax of the model's logits. processed: after temperature,
    top-k and top-p."""
    attention_backend: str = "auto"
    """`torch` (SDPA over gathered blocks; CPU and GPU), `triton` (paged kernels in
    kernels/; CUDA, or CPU under TRITON_INTERPRET=1), `flashinfer` (FlashInfer's paged
    kernels for the attention, our Triton kernels for the rest; CUDA with the flashinfer
    package: engine/attention_flashinfer.py says why it is not the default), or `auto`:
    triton on CUDA, else torch."""
    enable_cuda_graphs: bool = True
    """Replay captured CUDA graphs for decode-only steps (triton backend, CUDA, pp=1)."""
    cuda_graph_max_batch: int = 256
    """Largest decode batch served by a graph; bigger batches run eagerly."""
    cuda_graph_max_context: int = 131072
    """Longest context a graphed decode step serves (capped by the model's and the
    scheduler's maximum); longer ones run eagerly. Graphs come per context bucket
    (8k tokens, ×4, …, this; engine/cuda_graphs.py), each sized for its contexts."""
    cuda_graph_mixed_max_tokens: int = 512
    """Steps with prefill chunks (aggregated serving: chunks beside the decodes) of at most this
    many tokens replay a CUDA graph of the forward pass too (engine/mixed_graphs.py; triton
    backend); 0: they run eagerly. Larger steps are bound by their GEMMs, not by launches."""
    async_scheduling: bool | None = None
    """Schedule decode step N+1 while step N runs on the device (greedy decode-only
    steps; see engine/step_pipeline.py). None: on when CUDA graphs are in use."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a checkpoint directory path, got {self.model!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.role not in ("aggregated", "prefill", "decode"):
            raise ValueError(f"role must be aggregated, prefill or decode, got {self.role!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )
        _positive("cuda_graph_max_batch", self.cuda_graph_max_batch)
        _positive("cuda_graph_max_context", self.cuda_graph_max_context)
        if self.cuda_graph_mixed_max_tokens < 0:
            raise ValueError(f"cuda_graph_mixed_max_tokens must be >= 0, got {self.cuda_graph_mixed_max_tokens}")
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(
                f"logprobs_mode must be 'raw_logprobs' or 'processed_logprobs', got {self.logprobs_mode!r}"
            )
