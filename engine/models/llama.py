"""Llama-family decoder (Llama 2/3, Mistral w/o sliding window, Qwen2) over a paged KV cache.

Tensor parallel (Megatron style): q/k/v and gate/up are split by output rows
(heads / intermediate channels), o_proj and down_proj by input columns and
summed with an all-reduce. Embedding and lm_head are replicated. Pipeline
parallel: a stage owns layers [start, end); the first stage embeds, the last
normalises and projects to the vocabulary.

Shapes use a flat token batch: T tokens of several sequences, hidden [T, hidden].
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from splitserve import kernels
from splitserve.engine.attention import AttentionMetadata, paged_attention
from splitserve.engine.models.config import ModelConfig
from splitserve.engine.models.fused import fuse_projections, fused_layers_forward, gathers_embedding
from splitserve.engine.models.fused import head as fused_head
from splitserve.engine.models.rope import RotaryEmbedding, StepRotary, apply_rotary
from splitserve.engine.parallel import ParallelState, kv_heads_of_rank, stage_layer_range


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    """GQA attention over the paged KV. `qkv_bias` / `o_bias` default to the Llama family's
    (q/k/v bias as the config says, none on o_proj); hybrid models set both to their
    `attention_bias` and pass no rotary (cos/sin None: NemotronH has no positional encoding)."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState, *, qkv_bias: bool | None = None, o_bias: bool = False):
        super().__init__()
        if cfg.num_heads % ps.tp_size:
            raise ValueError(f"{cfg.num_heads} attention heads cannot be split over tp={ps.tp_size}")
        self.ps = ps
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_heads // ps.tp_size
        kv_start, kv_end = kv_heads_of_rank(cfg.num_kv_heads, ps.tp_size, ps.tp_rank)
        self.num_kv_heads = kv_end - kv_start
        self.scale = cfg.head_dim**-0.5
        d, h = cfg.head_dim, cfg.hidden_size
        bias = cfg.qkv_bias if qkv_bias is None else qkv_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=o_bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, kv: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if cos is not None:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = paged_attention(q, k, v, kv, meta, self.scale)
        return self.ps.all_reduce_tp(self.o_proj(o.reshape(t, -1)))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState):
        super().__init__()
        if cfg.intermediate_size % ps.tp_size:
            raise ValueError(f"intermediate_size {cfg.intermediate_size} cannot be split over tp={ps.tp_size}")
        self.ps = ps
        inter = cfg.intermediate_size // ps.tp_size
        self.gate_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ps.all_reduce_tp(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState):
        super().__init__()
        self.self_attn = Attention(cfg, ps)
        self.mlp = MLP(cfg, ps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, kv, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """One pipeline stage of the model on one tensor-parallel rank."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState):
        super().__init__()
        self.cfg = cfg
        self.ps = ps
        self.layer_start, self.layer_end = stage_layer_range(cfg.num_layers, ps.pp_size, ps.pp_rank)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        needs_embed = ps.is_first_stage or (ps.is_last_stage and cfg.tie_word_embeddings)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if needs_embed else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, ps) for _ in range(self.layer_end - self.layer_start))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if ps.is_last_stage else None
        self.fused = False
        """Run the GPU form of the layers (`fused.py`); set by `fuse_projections`."""
        self.lm_head = None
        if ps.is_last_stage and not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def num_local_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def num_local_kv_heads(self) -> int:
        return self.layers[0].self_attn.num_kv_heads if len(self.layers) else 0

    def forward(
        self,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: Sequence[torch.Tensor],
        input_ids: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """input_ids [T] on the first stage, else `hidden` [T, hidden] from the previous stage.
        `after_layer(i)` runs once local layer i has written its KV (queued it, on a GPU)."""
        ids = None
        if self.ps.is_first_stage and self.fused and gathers_embedding(self):
            ids = input_ids  # gathered by the first layer's norm kernel (fused.GATHER_EMBEDDING)
        elif self.ps.is_first_stage:
            hidden = self.embed_tokens(input_ids)
        dtype = self.embed_tokens.weight.dtype if ids is not None else hidden.dtype
        if self.fused:
            rope = StepRotary(self.rotary, positions, dtype)
            return fused_layers_forward(self, hidden, rope, kv_caches, meta, after_layer, input_ids=ids)
        cos, sin = self.rotary.cos_sin(positions, dtype)
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches, strict=True)):
            hidden = layer(hidden, cos, sin, kv, meta)
            if after_layer is not None:
                after_layer(i)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab] (last stage only)."""
        return self._head(hidden, False)[0]

    def logits_and_argmax(self, hidden: torch.Tensor, keep_rows: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`compute_logits`, and each row's argmax where the LM head's kernel took it in its
        epilogue (fused models on the GPU at decode sizes), else None: the caller takes it.
        `keep_rows`: integer [N], nonzero where the caller reads the row's logits; where the
        kernel takes the argmax, the other rows' logits may be left unwritten."""
        return self._head(hidden, True, keep_rows)

    def _head(self, hidden: torch.Tensor, argmax: bool, keep_rows: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.fused:
            return fused_head(self.norm, hidden, weight, argmax, keep_rows)
        return F.linear(self.norm(hidden), weight).float(), None


def build_model(cfg: ModelConfig, ps: ParallelState, path: str, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Construct without initialising weights (meta device), then load the checkpoint."""
    from splitserve.engine.models.loader import load_weights

    if cfg.is_hybrid:  # NemotronH-style Mamba2 + attention + MLP (hybrid.py)
        from splitserve.engine.models.hybrid import HybridCausalLM

        with torch.device("meta"):
            model = HybridCausalLM(cfg, ps)
        model = model.to_empty(device=device)
        load_weights(model, path, dtype, device)
        return model
    with torch.device("meta"):
        model = CausalLM(cfg, ps)
    model = model.to_empty(device=device)
    model.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings).to(device)
    load_weights(model, path, dtype, device)
    if device.type == "cuda" and kernels.triton_available():
        fuse_projections(model)
    return model
