"""Runs one scheduled step on this rank: builds the flat batch and attention
metadata, runs its pipeline stage, and (on the driver) samples (engine/step_sampling.py).

    SchedulerOutput ──▶ input_ids/positions/slots ──▶ stage 0 ──hidden──▶ … ──▶ last stage
                                                                                 │ logits
                                         every rank ◀── broadcast ◀── driver: sample
"""

from __future__ import annotations

from dataclasses import replace

import torch

from splitserve.engine.batch import prepare_inputs
from splitserve.engine.config import EngineConfig
from splitserve.engine.devices import resolve_device
from splitserve.engine.kv_cache import allocate_kv_caches, num_blocks_for
from splitserve.engine.logit_slots import LogitSlots
from splitserve.engine.models.config import ModelConfig
from splitserve.engine.models.llama import build_model
from splitserve.engine.parallel import ParallelState
from splitserve.engine.scheduler import SchedulerOutput
from splitserve.engine.step_sampling import ChunkResult, PendingStep, StepSampling, greedy_ids

__all__ = ["ChunkResult", "ModelRunner", "PendingStep", "greedy_ids", "resolve_backend", "resolve_dtype"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_backend(name: str, device: torch.device) -> str:
    if name == "flashinfer":
        from splitserve.engine import attention_flashinfer

        if device.type != "cuda":
            raise ValueError("attention_backend=flashinfer needs a CUDA device")
        attention_flashinfer.require()
    if name != "auto":
        return name
    from splitserve import kernels

    return "triton" if device.type == "cuda" and kernels.triton_available() else "torch"


def resolve_dtype(name: str, model: ModelConfig, device: torch.device) -> torch.dtype:
    """`auto`: the checkpoint's dtype on GPU; float32 on CPU, where half-precision
    matmuls are slow and would change numerics against references."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES.get(model.torch_dtype, torch.bfloat16)


class ModelRunner(StepSampling):
    """Builds and runs a step's forward pass on this rank; sampling is `StepSampling`
    (engine/step_sampling.py)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, ps: ParallelState, seed: int = 0):
        self.config = config
        self.ps = ps
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_config, self.device)
        self.model = build_model(model_config, ps, config.model, self.dtype, self.device)
        self.states = None
        """Recurrent-state slots and prefix store (hybrid models only; state_manager.py)."""
        if model_config.is_hybrid:
            from splitserve.engine.state_manager import StateManager

            self.states = StateManager(config, model_config, self.model, self.dtype, self.device)
        self.block_size = config.cache.block_size_tokens
        self.num_blocks = num_blocks_for(model_config, ps, config.cache, self.dtype)
        # One block more than the pool hands out: the scratch block that padded
        # rows of a CUDA-graph batch write to and read from.
        self.scratch_block = self.num_blocks
        self.kv_caches = allocate_kv_caches(
            self.model.num_local_layers,
            self.num_blocks + 1,
            self.model.num_local_kv_heads,
            self.block_size,
            model_config.head_dim,
            self.dtype,
            self.device,
        )
        self._hidden_size = model_config.hidden_size
        self.backend = resolve_backend(config.attention_backend, self.device)
        from splitserve import kernels

        self._triton_argmax = self.device.type == "cuda" and kernels.triton_available()
        """Eager greedy steps take the Triton argmax (greedy_ids)."""
        self._draws_at_launch = self.device.type != "cuda" or self._triton_argmax
        """A decode step's sampled rows are drawn at launch (`_draw_at_launch`: the batched
        device sampler needs Triton; on CPU the host sampler draws there)."""
        self._guided_draws = self._triton_argmax
        """Sampled guided rows are drawn by the batched device sampler (`_guided_batch`)."""
        self.flashinfer = self._flashinfer_shape()
        """flashinfer backend: what its wrappers are planned for (attention_flashinfer.Shape)."""
        self.planner = None
        if self.flashinfer is not None:
            from splitserve.engine.attention_flashinfer import FlashInferPlanner

            self.planner = FlashInferPlanner(self.device, self.flashinfer)
        self.logit_slots = LogitSlots(model_config.vocab_size, self.device)  # bias / penalty state per request
        self.graphs = None
        if (
            self.backend in ("triton", "flashinfer")
            and self.device.type == "cuda"
            and config.enable_cuda_graphs
            and ps.pp_size == 1
            and self.states is None  # graphs capture attention-only models
        ):
            from splitserve.engine.cuda_graphs import DecodeGraphs

            max_len = min(
                config.scheduler.max_sequence_length or model_config.max_position_embeddings,
                config.cuda_graph_max_context,
            )
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_caches,
                max_batch=min(config.cuda_graph_max_batch, config.scheduler.max_requests),
                max_blocks=-(-max_len // self.block_size),
                scratch_block=self.scratch_block,
                block_size=self.block_size,
                flashinfer=self.flashinfer,
            )
            mixed_tokens = min(config.cuda_graph_mixed_max_tokens, config.scheduler.max_tokens)
            if mixed_tokens and self.backend == "triton":
                from splitserve.engine.mixed_graphs import MixedGraphs

                self.graphs.mixed = MixedGraphs(self.graphs, mixed_tokens)
        self.layer_listener = None
        """Prefill role with layer-wise streaming (engine/handoff_layerwise.py `LayerPublisher`):
        told when a step's forward pass starts, and called after each local layer of it."""
        self._base_seeds: dict[str, int] = {}
        self._seed_source = torch.Generator().manual_seed(seed)

    def _flashinfer_shape(self):
        if self.backend != "flashinfer":
            return None
        from splitserve.engine.attention_flashinfer import Shape

        if self.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"attention_backend=flashinfer needs float16 or bfloat16, not {self.dtype}")
        attn = next((m for m in self.model.modules() if hasattr(m, "num_kv_heads") and hasattr(m, "scale")), None)
        if attn is None:
            raise ValueError("attention_backend=flashinfer: this model has no attention layer on this rank")
        return Shape(attn.num_heads, attn.num_kv_heads, attn.head_dim, self.block_size, self.dtype, attn.scale)

    # --------------------------------------------------------------- execute
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[ChunkResult]:
        return self.collect(self.launch(out))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, feed: PendingStep | None = None) -> PendingStep:
        """Queue the step's forward on the device; `collect` samples from it. On a
        GPU the two are apart so the engine can do host work while the step runs.

        `feed`: the previous step, still in flight, whose greedy tokens are this
        decode-only step's input ids, row for row (async scheduling)."""
        fed = feed.greedy[: len(out.chunks)] if feed is not None else None
        if self.graphs is not None and self.graphs.can_run(out):
            logits, greedy = self.graphs.launch(out, fed)
            return self._decode_pending(out, logits, greedy, graphed=True, fed=fed)
        mixed = self.graphs.mixed if self.graphs is not None else None
        if mixed is not None and fed is None and self.layer_listener is None and mixed.can_run(out):
            return PendingStep(out, hidden=mixed.launch(out))  # a step with prefill chunks (mixed_graphs.py)
        inputs = prepare_inputs(out, self.block_size, self.scratch_block, self.backend, self.device, self.planner)
        if fed is not None:
            inputs.input_ids[: len(fed)].copy_(fed)
        hidden = None
        if not self.ps.is_first_stage:
            hidden = self.ps.recv_prev((len(inputs.input_ids), self._hidden_size), self.dtype, self.device)
        extra = {}
        if self.states is not None:  # hybrid: the mixers' recurrent-state slots for this step
            extra = dict(mamba_meta=self.states.prepare(out, self.backend, self.device), mamba_states=self.states.layers)
        drain = None
        if self.layer_listener is not None:
            after_layer = self.layer_listener.forward_started(out)
            if after_layer is not None and self.states is None:  # hybrid layers: marked after the step
                extra["after_layer"] = after_layer
                drain = getattr(after_layer, "drain", None)
        hidden = self.model(
            inputs.positions, inputs.meta, self.kv_caches, input_ids=inputs.input_ids, hidden=hidden, **extra
        )
        pending = self._after_forward(out, inputs, hidden, fed)
        return pending if drain is None else replace(pending, layer_marks=drain)

    def _after_forward(self, out: SchedulerOutput, inputs, hidden: torch.Tensor, fed=None) -> PendingStep:
        if self.states is not None:
            self.states.finish(out)
        if not self.ps.is_last_stage:
            self.ps.send_next(hidden)
            return PendingStep(out)
        if self.ps.is_driver and inputs.meta.is_decode_only and not any(
            c.request.wants_prompt_log_probs and c.start < c.request.prompt_len for c in out.chunks
        ):
            logits, greedy = self.model.logits_and_argmax(hidden)
            if greedy is None:  # no kernel took it in the LM head's epilogue
                greedy = greedy_ids(logits, self._triton_argmax)
            return self._decode_pending(out, logits, greedy, fed=fed)
        return PendingStep(out, hidden=hidden)

    def forget(self, request_id: str) -> None:
        self._base_seeds.pop(request_id, None)
        if self.states is not None:
            self.states.forget(request_id)
