"""Paged attention in plain torch (CPU and CUDA): write new K/V into the block
pool, then attend over each sequence's blocks.

KV cache of one layer on one rank:

    kv[2, num_blocks, num_kv_heads_local, block_size, head_dim]     (0 = K, 1 = V)

A contiguous kv-head range of one block is one contiguous region, which keeps
handoff resharding cheap. Token t of a sequence lives at
`block_table[t // block_size]`, offset `t % block_size`; `slot = block * block_size + offset`.

Decodes (one query token each) are batched with a padded block table; each
prefill chunk runs on its own so a long prompt never pads the decodes.
Triton kernels (kernels/) or FlashInfer (attention_flashinfer.py) replace this on GPU;
this stays the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillSeq:
    q_start: int
    """Index of the chunk's first token in the flat batch."""
    q_len: int
    ctx_len: int
    """Tokens with KV after this step (cached prefix + the chunk)."""
    block_table: torch.Tensor
    """[ceil(ctx_len / block_size)] int64 block ids."""


_EMPTY = torch.empty(0, dtype=torch.long)

TRITON_KERNEL_BACKENDS = ("triton", "flashinfer")
"""Backends whose steps run our Triton kernels (fused rotary + KV write, SSM scans); `flashinfer`
swaps in FlashInfer for the attention itself and keeps the rest."""


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """[T] int64 cache slot of every token in the flat batch."""
    backend: str = "torch"
    """`torch` (this module, any device), `triton` (kernels/, CUDA or the interpreter) or
    `flashinfer` (the triton fields, attention by `planned`)."""
    is_decode_only: bool = False
    """Every sequence contributes exactly one token (the CUDA-graph case)."""
    # --- torch backend
    decode_token_idx: torch.Tensor = _EMPTY
    """[B] flat-batch index of each decode token."""
    decode_block_tables: torch.Tensor = _EMPTY
    """[B, max_blocks] int64, padded with block 0 (masked out)."""
    decode_ctx_lens: torch.Tensor = _EMPTY
    """[B] int64 context length including the new token."""
    prefills: tuple[PrefillSeq, ...] = ()
    # --- triton backend: every sequence, in flat-batch order
    block_tables: torch.Tensor = _EMPTY
    """[S, max_blocks] int64, padded with the scratch block."""
    q_starts: torch.Tensor = _EMPTY
    """[S + 1] cumulative token offsets of the sequences in the flat batch."""
    ctx_lens: torch.Tensor = _EMPTY
    """[S] tokens with KV after this step."""
    planned: object | None = None
    """flashinfer backend: the step's planned FlashInfer wrapper (attention_flashinfer.py)."""


def write_kv(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter k, v [T, H, D] into kv [2, NB, H, BS, D] at `slot_mapping` [T]."""
    block_size = kv.shape[3]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    kv[0, blocks, :, offsets] = k.to(kv.dtype)
    kv[1, blocks, :, offsets] = v.to(kv.dtype)


def _gather(kv_half: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """kv_half [NB, H, BS, D], block_table [..., nb] -> [..., H, nb*BS, D]."""
    x = kv_half[block_table]  # [..., nb, H, BS, D]
    x = x.movedim(-3, -4)  # [..., H, nb, BS, D]
    return x.flatten(-3, -2)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] for the new tokens -> output [T, Hq, D]."""
    if meta.backend in TRITON_KERNEL_BACKENDS:
        return _triton_attention(q, k, v, kv, meta, scale)
    write_kv(kv, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    if meta.decode_token_idx.numel():
        keys = _gather(kv[0], meta.decode_block_tables)  # [B, H, L, D]
        values = _gather(kv[1], meta.decode_block_tables)
        mask = torch.arange(keys.shape[2], device=q.device)[None, :] < meta.decode_ctx_lens[:, None]
        qd = q[meta.decode_token_idx].unsqueeze(2)  # [B, Hq, 1, D]
        o = F.scaled_dot_product_attention(
            qd, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
        )
        out[meta.decode_token_idx] = o.squeeze(2)
    for seq in meta.prefills:
        keys = _gather(kv[0], seq.block_table)[:, : seq.ctx_len].to(q.dtype)  # [H, ctx, D]
        values = _gather(kv[1], seq.block_table)[:, : seq.ctx_len].to(q.dtype)
        qs = q[seq.q_start : seq.q_start + seq.q_len].transpose(0, 1)  # [Hq, q_len, D]
        if seq.q_len == seq.ctx_len:
            o = F.scaled_dot_product_attention(qs, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            offset = seq.ctx_len - seq.q_len
            rows = torch.arange(seq.q_len, device=q.device)[:, None] + offset
            mask = torch.arange(seq.ctx_len, device=q.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[seq.q_start : seq.q_start + seq.q_len] = o.transpose(0, 1)
    return out


def _triton_attention(q, k, v, kv, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    from splitserve import kernels

    kernels.write_kv(kv, k, v, meta.slot_mapping)
    return triton_attention_written(q, kv, meta, scale)


def triton_attention_written(q, kv, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Triton (or FlashInfer) backend, the new tokens' K/V already in `kv` (e.g. written by the
    fused rotary kernel of models/fused.py). FlashInfer was planned with the same `scale`."""
    from splitserve import kernels

    if meta.planned is not None:
        return meta.planned.run(q, kv)
    if meta.is_decode_only:  # one token per sequence: the flash-decoding kernel
        return kernels.paged_decode_attention(q, kv, meta.block_tables, meta.ctx_lens, scale)
    return kernels.paged_prefill_attention(q, kv, meta.block_tables, meta.q_starts, meta.ctx_lens, scale)
