"""Engine-side lifecycle for reinforcement-learning loops (the control plane
drives it; see control_plane/lifecycle.py for the states):

    suspend(engine)          free the KV memory (and a hybrid model's recurrent-state memory),
                             keep the process and the weights
    resume(engine)           reallocate it (zeroed); the tensors keep their shapes
    reload_weights(engine, path)   load a new checkpoint of the same architecture

Suspending drops every handoff pin and preempts running requests back to the
waiting queue (they are recomputed after resume), and clears the prefix cache,
so nothing refers to freed memory. Called on every rank of a group, in step.

No warm-up (engine/warmup.py) runs after a resume, although suspending drops the CUDA graphs:
an RL loop resumes once per weight sync, where a sweep over every batch bucket would cost each
sync seconds, while the first batches after it recapture only the graphs they need (tens of
ms each; the Triton kernels stay compiled in the process).
"""

from __future__ import annotations

import dataclasses

import torch

from splitserve.engine.models.config import ModelConfig
from splitserve.engine.models.fused import fuse_projections
from splitserve.engine.models.loader import load_weights
from splitserve.engine.transfer.graph_copy import forget_pools


def suspend(engine) -> None:
    engine.flush()  # no request may hold a placeholder token when it is preempted
    for request_id in list(engine.handoffs):
        engine.release_handoff(request_id)
    engine.scheduler.preempt_all()
    engine.pool.reset_prefix_cache()
    if getattr(engine.runner, "states", None) is not None:  # hybrid: cached states go with the cached KV
        engine.runner.states.reset_prefix_cache()
    if engine.runner.graphs is not None:
        engine.runner.graphs.reset()
    for t in _memory(engine):
        t.untyped_storage().resize_(0)
    forget_pools()  # copy graphs baked in the freed addresses
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    engine.is_suspended = True


def resume(engine) -> None:
    for t in _memory(engine):
        # A CPU pool may be a view into a huge-page-aligned allocation (engine/host_memory.py).
        t.untyped_storage().resize_((t.storage_offset() + t.numel()) * t.element_size())
        t.zero_()
    forget_pools()  # the same tensor objects, new memory: no remembered pool pair may stand for them
    engine.is_suspended = False


def _memory(engine) -> list[torch.Tensor]:
    """What suspend frees: the KV pools, and a hybrid model's recurrent states (slots and prefix
    cache; a request that held a slot restarts from token 0, which zeroes it)."""
    states = getattr(engine.runner, "states", None)
    return [*engine.kv_caches, *(states.pool.tensors() if states is not None else ())]


_SHAPE_FIELDS = ("family", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size", "tie_word_embeddings", "qkv_bias")


def reload_weights(engine, path: str) -> None:
    """Load `path` into the running model. Refuses a different architecture."""
    new = ModelConfig.from_checkpoint(path)
    old = engine.model_config
    diff = [f for f in _SHAPE_FIELDS if getattr(new, f) != getattr(old, f)]
    if diff:
        raise ValueError(f"checkpoint {path!r} differs in {diff}; reload needs the same architecture")
    if not getattr(engine, "is_simulated", False):  # a simulated engine has no weights to load
        load_weights(engine.runner.model, path, engine.runner.dtype, engine.runner.device)
        if getattr(engine.runner.model, "fused", False):  # the loader replaced the fused weights' views
            fuse_projections(engine.runner.model)
    engine.model_path = path
    engine.model_config = dataclasses.replace(old, name=new.name)
    engine.pool.reset_prefix_cache()  # cached KV was computed by the old weights
    if getattr(engine.runner, "states", None) is not None:
        engine.runner.states.reset_prefix_cache()
