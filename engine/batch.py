"""One step's flat token batch and attention metadata, built from the scheduler's output.

    chunks:   [req a: 1 token][req b: 1 token][req c: 37 tokens]...
    flat:     input_ids / positions / slot_mapping, one entry per token, in chunk order
    slot(t) = block_table[t // block_size] * block_size + t % block_size

Two attention backends read different fields (see `attention.py`): the torch
path wants decode rows batched apart from per-sequence prefill chunks; the
Triton path wants every sequence's block table, `q_starts` and context length
(FlashInfer the same, planned once here for all layers: attention_flashinfer.py).
Padding entries point at the scratch block (`scratch_block`, never handed out by
the pool), so a padded row of a CUDA-graph batch can write and read harmlessly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.attention import TRITON_KERNEL_BACKENDS, AttentionMetadata, PrefillSeq
from splitserve.engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


def _tensor(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def prepare_inputs(
    out: SchedulerOutput, block_size: int, scratch_block: int, backend: str, device: torch.device, planner=None
) -> StepInputs:
    """`planner`: the engine's `FlashInferPlanner` (flashinfer backend)."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    tables: list[list[int]] = []
    ctx_lens: list[int] = []
    q_starts = [0]
    for chunk in out.chunks:
        req = chunk.request
        pos = range(chunk.start, chunk.start + chunk.num_tokens)
        ids.extend(req.token_slice(chunk.start, chunk.start + chunk.num_tokens))
        positions.extend(pos)
        slots.extend(req.block_ids[p // block_size] * block_size + p % block_size for p in pos)
        ctx_len = chunk.start + chunk.num_tokens
        tables.append(req.block_ids[: -(-ctx_len // block_size)])
        ctx_lens.append(ctx_len)
        q_starts.append(len(ids))
    is_decode_only = all(c.num_tokens == 1 for c in out.chunks)
    if backend in TRITON_KERNEL_BACKENDS:
        width = max(len(t) for t in tables)
        padded = [t + [scratch_block] * (width - len(t)) for t in tables]
        planned = planner.plan(padded, ctx_lens, q_starts, is_decode_only) if planner is not None else None
        meta = AttentionMetadata(
            slot_mapping=_tensor(slots, device),
            backend=backend,
            is_decode_only=is_decode_only,
            block_tables=_tensor(padded, device),
            q_starts=_tensor(q_starts, device),
            ctx_lens=_tensor(ctx_lens, device),
            planned=planned,
        )
        return StepInputs(_tensor(ids, device), _tensor(positions, device), meta)

    decode_idx, decode_tables, decode_lens, prefills = [], [], [], []
    for i, (table, ctx_len) in enumerate(zip(tables, ctx_lens, strict=True)):
        q_start, q_len = q_starts[i], q_starts[i + 1] - q_starts[i]
        if q_len == 1:
            decode_idx.append(q_start)
            decode_tables.append(table)
            decode_lens.append(ctx_len)
        else:
            prefills.append(PrefillSeq(q_start, q_len, ctx_len, _tensor(table, device)))
    width = max((len(t) for t in decode_tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in decode_tables]
    meta = AttentionMetadata(
        slot_mapping=_tensor(slots, device),
        decode_token_idx=_tensor(decode_idx, device),
        decode_block_tables=_tensor(padded, device).reshape(len(padded), width),
        decode_ctx_lens=_tensor(decode_lens, device),
        prefills=tuple(prefills),
        is_decode_only=is_decode_only,
    )
    return StepInputs(_tensor(ids, device), _tensor(positions, device), meta)
