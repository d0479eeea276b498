"""Per-step bookkeeping of the recurrent state of hybrid models (one per model runner).

    prepare(step)  free preempted slots ─▶ each chunk: take a slot; if the chunk does not
                   continue the slot's state, reset it (start 0) or load the cached state
                   of the block boundary it starts at ─▶ plan saves at block boundaries
                   inside prefill chunks ─▶ MambaMetadata
    forward        the mixers read/update slots, copy interior saves to the prefix store
    finish(step)   positions advance; a chunk ending on a block boundary saves its slot

The scheduler asks `usable_prefix_blocks` how much of a KV prefix hit it may use: only
up to the deepest block boundary whose state is cached.
"""

from __future__ import annotations

import torch

from splitserve.engine.attention import TRITON_KERNEL_BACKENDS
from splitserve.engine.block_hash import BlockHash
from splitserve.engine.config import EngineConfig
from splitserve.engine.models.config import ModelConfig
from splitserve.engine.models.mamba2 import MambaMetadata, MambaPrefill
from splitserve.engine.parallel import stage_layer_range
from splitserve.engine.scheduler import SchedulerOutput
from splitserve.engine.state_pool import StatePool, state_bytes

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def state_dtypes(config: EngineConfig, model_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(conv, ssm) state dtypes: `auto` = the model dtype for conv, float32 for SSM."""
    cache = config.cache
    conv = model_dtype if cache.conv_state_dtype == "auto" else _DTYPES[cache.conv_state_dtype]
    ssm = torch.float32 if cache.mamba_state_dtype == "auto" else _DTYPES[cache.mamba_state_dtype]
    return conv, ssm


class StateManager:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model, dtype: torch.dtype, device: torch.device):
        self.block_size = config.cache.block_size_tokens
        conv_dtype, ssm_dtype = state_dtypes(config, dtype)
        shapes = [
            ((m.conv_dim, model_config.conv_kernel - 1), (m.num_heads, m.head_dim, m.state_size))
            for m in model.mamba_mixers()
        ]
        # Every rank must agree on the prefix-store size: size it for the stage with the most mamba layers.
        ps = model.ps
        most = max(
            sum(1 for t in model_config.layer_types[slice(*stage_layer_range(model_config.num_layers, ps.pp_size, s))]
                if t == "mamba")
            for s in range(ps.pp_size)
        )
        one = shapes[0] if shapes else (
            (model_config.mamba_conv_dim // ps.tp_size, model_config.conv_kernel - 1),
            (model_config.mamba_num_heads // ps.tp_size, model_config.mamba_head_dim, model_config.ssm_state_size),
        )
        per_state = max(1, state_bytes([one] * max(1, most), conv_dtype, ssm_dtype))
        num_prefix = 0
        if config.cache.enable_prefix_caching:
            num_prefix = int(config.cache.prefix_caching_mamba_gb * 1024**3) // per_state
        num_slots = config.cache.mamba_state_slots or 2 * config.scheduler.max_requests
        self.pool = StatePool(shapes, num_slots, num_prefix, conv_dtype, ssm_dtype, device)
        self._end_saves: list[tuple[str, int]] = []

    @property
    def layers(self):
        return self.pool.layers

    # ------------------------------------------------------------ scheduling
    def usable_prefix_blocks(self, block_hashes: list[BlockHash]) -> int:
        """How many of the KV-hit blocks `block_hashes` a request may resume after."""
        for k in range(len(block_hashes), 0, -1):
            if block_hashes[k - 1] in self.pool.prefix:
                return k
        return 0

    # ------------------------------------------------------------------ step
    def prepare(self, out: SchedulerOutput, backend: str, device: torch.device) -> MambaMetadata:
        pool, bs = self.pool, self.block_size
        for request_id in out.preempted_ids:
            pool.release(request_id)
        for chunk in out.chunks:  # all loads before any save: a save may evict
            req = chunk.request
            slot = pool.acquire(req.request_id)
            if pool.position.get(req.request_id) == chunk.start:
                continue
            if chunk.start == 0:
                pool.reset(slot)
                continue
            index = pool.prefix.get(req.block_hashes[chunk.start // bs - 1]) if chunk.start % bs == 0 else None
            if index is None:
                raise RuntimeError(
                    f"request {req.request_id} resumes at token {chunk.start} but no recurrent state is cached there"
                )
            pool.load_prefix(slot, index)
        decode_idx, decode_slots, prefills = [], [], []
        self._end_saves = []
        offset = 0
        for chunk in out.chunks:
            req = chunk.request
            slot = pool.slot_of(req.request_id)
            end = chunk.start + chunk.num_tokens
            req.extend_block_hashes(bs)
            saves = []
            for boundary in range((chunk.start // bs + 1) * bs, end + 1, bs):
                block_hash = req.block_hashes[boundary // bs - 1]
                if block_hash in pool.prefix:
                    pool.prefix.get(block_hash)
                    continue
                index = pool.prefix.put(block_hash)
                if index is None:
                    break
                if boundary == end:
                    self._end_saves.append((req.request_id, index))
                else:
                    saves.append((boundary - chunk.start, index))
            if chunk.num_tokens == 1:
                decode_idx.append(offset)
                decode_slots.append(slot)
            else:
                prefills.append(MambaPrefill(offset, chunk.num_tokens, slot, tuple(saves)))
            offset += chunk.num_tokens
        return MambaMetadata(
            decode_token_idx=torch.tensor(decode_idx, dtype=torch.long, device=device),
            decode_slots=torch.tensor(decode_slots, dtype=torch.long, device=device),
            prefills=tuple(prefills),
            backend=backend if backend in TRITON_KERNEL_BACKENDS else "torch",
        )

    def finish(self, out: SchedulerOutput) -> None:
        pool = self.pool
        for chunk in out.chunks:
            pool.position[chunk.request.request_id] = chunk.start + chunk.num_tokens
        for request_id, index in self._end_saves:
            slot = pool.slot_of(request_id)
            for layer in pool.layers:
                layer.prefix_conv[index].copy_(layer.conv[slot])
                layer.prefix_ssm[index].copy_(layer.ssm[slot])
        self._end_saves = []

    # ------------------------------------------------------------- lifecycle
    def forget(self, request_id: str) -> None:
        """A request left the engine; its slot goes back unless a handoff pinned it."""
        if request_id not in self.pool.pinned:
            self.pool.release(request_id)

    def pin(self, request_id: str) -> None:
        """Keep a finished prefill request's state for its handoff (until `unpin`)."""
        if self.pool.slot_of(request_id) is not None:
            self.pool.pinned.add(request_id)

    def unpin(self, request_id: str) -> None:
        self.pool.release(request_id)

    def import_slot(self, request_id: str, num_tokens: int) -> int:
        """Decode role: a slot for an imported request whose state (after `num_tokens`) a handoff fills."""
        slot = self.pool.acquire(request_id)
        self.pool.position[request_id] = num_tokens
        return slot

    def reset_prefix_cache(self) -> None:
        self.pool.prefix.clear()
