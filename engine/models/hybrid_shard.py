"""Tensor-parallel slicing of a hybrid (NemotronH) checkpoint's tensors for one rank.

Attention and MLP weights split like Llama's (q/k/v/up by rows, o/down by columns);
mamba weights by heads and groups (see `mamba2.py`): in_proj and the conv gather
non-contiguous rows, so they come back as index tensors.
"""

from __future__ import annotations

import torch

from splitserve.engine.models.config import ModelConfig
from splitserve.engine.models.mamba2 import conv_channel_index, in_proj_row_index, mamba_shard
from splitserve.engine.parallel import ParallelState

Shard = tuple[int, slice | torch.Tensor] | None


def hybrid_shard(name: str, cfg: ModelConfig, ps: ParallelState) -> Shard | bool:
    """The shard of `name` for this rank, None if replicated, or False: not a mamba / MLP
    tensor, let the generic (attention) rules decide."""
    if ".mixer." not in name:
        return None
    tp, r = ps.tp_size, ps.tp_rank
    leaf = name.split(".mixer.", 1)[1]
    heads, _ = mamba_shard(cfg, tp, r) if cfg.mamba_num_heads else (None, None)
    if leaf == "in_proj.weight" or leaf == "in_proj.bias":
        return 0, in_proj_row_index(cfg, tp, r)
    if leaf in ("conv1d.weight", "conv1d.bias"):
        return 0, conv_channel_index(cfg, tp, r)
    if leaf in ("dt_bias", "A_log", "D"):
        return 0, heads
    p = cfg.mamba_head_dim
    if leaf == "norm.weight":
        return 0, slice(heads.start * p, heads.stop * p)
    if leaf == "out_proj.weight":
        return 1, slice(heads.start * p, heads.stop * p)
    per = cfg.intermediate_size // tp
    if leaf == "up_proj.weight":
        return 0, slice(r * per, (r + 1) * per)
    if leaf == "down_proj.weight":
        return 1, slice(r * per, (r + 1) * per)
    return False  # q/k/v/o_proj: the Llama rules
