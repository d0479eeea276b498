"""Plain-torch references for the kernels in this package (any device, any dtype).

They compute in fp32 and return the input dtype, and they follow the engine's
KV layout exactly:

    kv[2, num_blocks, num_kv_heads, block_size, head_dim]     (0 = K, 1 = V)

    token t of a sequence:  block = block_table[t // block_size]
                            offset = t % block_size
                            slot = block * block_size + offset

    GQA: query head h reads kv head h // (num_q_heads // num_kv_heads).

A sequence with no context (ctx_len 0, e.g. a padded CUDA-graph row) attends to
nothing and gets zeros, in the references and the kernels alike.
"""

from __future__ import annotations

import torch


def gather_kv(kv_half: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """kv_half [NB, Hkv, BS, D], block_table [..., nb] -> [..., Hkv, nb * BS, D]."""
    x = kv_half[block_table.long()]  # [..., nb, Hkv, BS, D]
    x = x.movedim(-3, -4)  # [..., Hkv, nb, BS, D]
    return x.flatten(-3, -2)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """fp32 softmax attention with GQA.

    q [..., Hq, M, D], k/v [..., Hkv, L, D], visible [..., M, L] bool -> [..., Hq, M, D].
    Rows with nothing visible give zeros.
    """
    group = q.shape[-3] // k.shape[-3]
    k = k.float().repeat_interleave(group, dim=-3)
    v = v.float().repeat_interleave(group, dim=-3)
    scores = (q.float() @ k.transpose(-1, -2)) * scale  # [..., Hq, M, L]
    scores = scores.masked_fill(~visible.unsqueeze(-3), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows -> 0
    return probs @ v


def paged_decode_reference(
    q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, ctx_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query token per sequence over its first ctx_lens[b] cached tokens.

    q [B, Hq, D], kv [2, NB, Hkv, BS, D], block_tables [B, max_blocks] (int32/int64;
    entries past the context are ignored), ctx_lens [B] -> out [B, Hq, D] (q.dtype).
    """
    keys = gather_kv(kv[0], block_tables)  # [B, Hkv, L, D]
    values = gather_kv(kv[1], block_tables)
    positions = torch.arange(keys.shape[-2], device=q.device)
    visible = (positions[None, :] < ctx_lens.to(q.device)[:, None])[:, None, :]  # [B, 1, L]
    out = _attend(q.unsqueeze(-2), keys, values, visible, scale)  # [B, Hq, 1, D]
    return out.squeeze(-2).to(q.dtype)


def paged_prefill_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    block_tables: torch.Tensor,
    q_starts: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Varlen causal "extend" attention over a paged prefix.

    q [T, Hq, D] holds the new tokens of S sequences back to back; sequence s owns
    q[q_starts[s]:q_starts[s+1]], which are the LAST q_len tokens of its
    ctx_lens[s]-token context (their K/V are already in the cache). Row i of the
    chunk sits at context position ctx_len - q_len + i and sees positions <= that.

    kv [2, NB, Hkv, BS, D], block_tables [S, max_blocks], q_starts [S + 1],
    ctx_lens [S] -> out [T, Hq, D] (q.dtype).
    """
    out = torch.zeros_like(q)
    starts = q_starts.tolist()
    lens = ctx_lens.tolist()
    for s, ctx_len in enumerate(lens):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        keys = gather_kv(kv[0], block_tables[s])[:, :ctx_len]  # [Hkv, ctx, D]
        values = gather_kv(kv[1], block_tables[s])[:, :ctx_len]
        rows = torch.arange(q_len, device=q.device)[:, None] + (ctx_len - q_len)
        visible = torch.arange(ctx_len, device=q.device)[None, :] <= rows  # [q_len, ctx]
        o = _attend(q[q_start:q_end].transpose(0, 1), keys, values, visible, scale)  # [Hq, q_len, D]
        out[q_start:q_end] = o.transpose(0, 1).to(q.dtype)
    return out


def write_kv_reference(
    kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter k, v [T, Hkv, D] into kv [2, NB, Hkv, BS, D] at slot_mapping [T], in place.

    Negative slots are skipped (padding tokens of a CUDA-graph batch).
    """
    block_size = kv.shape[3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    kv[0, blocks, :, offsets] = k[keep].to(kv.dtype)
    kv[1, blocks, :, offsets] = v[keep].to(kv.dtype)
