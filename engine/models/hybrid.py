"""Hybrid Mamba2 + attention + MLP models (NemotronH) over the paged KV and the recurrent state pool.

Each layer is `x + mixer(norm(x))` with one mixer chosen by the layer pattern
(`ModelConfig.layer_types`, e.g. NemotronH's `M*-M*-` = mamba, attention, mlp, ...):

    mamba      Mamba2Mixer (mamba2.py)                   state: conv + SSM per slot
    attention  GQA attention without positional encoding   state: paged KV
    mlp        up -> relu^2 -> down

Tensor parallel as in llama.py (heads / intermediate channels split, all-reduce
after the output projections); the mamba mixer splits heads and groups. Pipeline
parallel: a stage owns global layers [start, end); its KV tensors are those of its
attention layers, its state tensors those of its mamba layers, in layer order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.attention import AttentionMetadata
from splitserve.engine.models.config import ModelConfig
from splitserve.engine.models.llama import Attention, RMSNorm
from splitserve.engine.models.mamba2 import Mamba2Mixer, MambaLayerState, MambaMetadata
from splitserve.engine.parallel import ParallelState, kv_heads_of_rank, stage_layer_range


class Relu2MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState):
        super().__init__()
        if cfg.intermediate_size % ps.tp_size:
            raise ValueError(f"intermediate_size {cfg.intermediate_size} cannot be split over tp={ps.tp_size}")
        self.ps = ps
        inter = cfg.intermediate_size // ps.tp_size
        self.up_proj = nn.Linear(cfg.hidden_size, inter, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ps.all_reduce_tp(self.down_proj(F.relu(self.up_proj(x)).square()))


class HybridBlock(nn.Module):
    def __init__(self, kind: str, cfg: ModelConfig, ps: ParallelState):
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if kind == "mamba":
            self.mixer = Mamba2Mixer(cfg, ps)
        elif kind == "attention":
            self.mixer = Attention(cfg, ps, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias)
        else:
            self.mixer = Relu2MLP(cfg, ps)


class HybridCausalLM(nn.Module):
    """One pipeline stage of a hybrid model on one tensor-parallel rank."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState):
        super().__init__()
        self.cfg = cfg
        self.ps = ps
        self.layer_start, self.layer_end = stage_layer_range(cfg.num_layers, ps.pp_size, ps.pp_rank)
        kinds = cfg.layer_types[self.layer_start : self.layer_end]
        needs_embed = ps.is_first_stage or (ps.is_last_stage and cfg.tie_word_embeddings)
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if needs_embed else None
        self.layers = nn.ModuleList(HybridBlock(kind, cfg, ps) for kind in kinds)
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if ps.is_last_stage else None
        self.lm_head = None
        if ps.is_last_stage and not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = None
        self.fused = False
        """The fused GPU form (`fused.py`) covers Llama-family layers only."""
        self._kv_heads = kv_heads_of_rank(cfg.num_kv_heads, ps.tp_size, ps.tp_rank)

    @property
    def num_local_layers(self) -> int:
        """Local layers with a KV cache (the KV allocation count)."""
        return sum(1 for layer in self.layers if layer.kind == "attention")

    @property
    def num_local_mamba_layers(self) -> int:
        return sum(1 for layer in self.layers if layer.kind == "mamba")

    @property
    def num_local_kv_heads(self) -> int:
        return self._kv_heads[1] - self._kv_heads[0]

    def mamba_mixers(self) -> list[Mamba2Mixer]:
        return [layer.mixer for layer in self.layers if layer.kind == "mamba"]

    def forward(
        self,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: Sequence[torch.Tensor],
        input_ids: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
        mamba_meta: MambaMetadata | None = None,
        mamba_states: list[MambaLayerState] | None = None,
    ) -> torch.Tensor:
        """input_ids [T] on the first stage, else `hidden` [T, hidden]; `positions` is unused (no RoPE)."""
        if self.ps.is_first_stage:
            hidden = self.embeddings(input_ids)
        kv_iter, state_iter = iter(kv_caches), iter(mamba_states or ())
        for layer in self.layers:
            h = layer.norm(hidden)
            if layer.kind == "mamba":
                h = layer.mixer(h, next(state_iter), mamba_meta)
            elif layer.kind == "attention":
                h = layer.mixer(h, None, None, next(kv_iter), meta)
            else:
                h = layer.mixer(h)
            hidden = hidden + h
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab] (last stage only)."""
        return self._logits(hidden)

    def logits_and_argmax(self, hidden: torch.Tensor, keep_rows: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, None]:
        """`compute_logits` (every row, whatever `keep_rows` says); the argmax is the caller's (as
        `CausalLM.logits_and_argmax` where no kernel took it)."""
        return self._logits(hidden), None

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.norm_f(hidden)
        weight = self.embeddings.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, weight).float()
