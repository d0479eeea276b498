"""Paged prefill ("extend") attention over varlen sequences, flash-attention style.

    q [T, Hq, D] (new tokens of S sequences back to back), kv [2, NB, Hkv, BS, D],
    block_tables [S, max_blocks], q_starts [S + 1], ctx_lens [S] -> out [T, Hq, D]

Sequence s owns q rows [q_starts[s], q_starts[s+1]); they are the last q_len
tokens of its ctx_len-token context, so row i sits at position
prefix + i (prefix = ctx_len - q_len) and sees positions 0 ..= prefix + i.

One program = one tile of BLOCK_Q new tokens x all GROUP q heads of one kv head,
so K/V of the group are read once per tile. Tile rows are (token, head) pairs:

    row r -> token t0 + r // GROUP, q head kv_head * GROUP + r % GROUP

    keys:  |0 ........ full_end|........ kv_end|
            no mask needed       causal mask      (full_end: every row of the
                                                   tile sees all keys before it)

Grid (T // BLOCK_Q + S, Hkv): sequence s owns programs from q_starts[s] // BLOCK_Q + s
on, which is never fewer than ceil(q_len / BLOCK_Q); a program finds its sequence
by binary search over q_starts and exits if it has no tile. Sizes come from
shapes only: no host sync, CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LOG2_E, check_kv, check_last_dim_contiguous, dot_precision, next_power_of_2
from .reference import paged_prefill_reference

__all__ = ["paged_prefill_attention", "paged_prefill_reference"]

_BLOCK_N = 64  # keys per inner step


@triton.jit
def _find_sequence(q_starts_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest s with q_starts[s] // BLOCK_Q + s <= tile."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(q_starts_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# The sequence count and the block table's row stride (its width, which follows the longest
# sequence of the step) change from step to step and only index: not specialized on, so a
# step of a new shape compiles nothing while serving (a warm engine's first batch of 64
# 40-token prompts compiled this kernel for 0.57 s on an H200: benchmarks/RESULTS.md, session 25).
@triton.jit(do_not_specialize=["num_seqs", "stride_bt_s"])
def _prefill_kernel(
    q_ptr,
    kv_ptr,
    block_tables_ptr,
    q_starts_ptr,
    ctx_lens_ptr,
    out_ptr,
    scale_log2,
    num_seqs,
    stride_q_t,
    stride_q_h,
    stride_kv_kv,
    stride_kv_blk,
    stride_kv_h,
    stride_kv_tok,
    stride_bt_s,
    stride_o_t,
    stride_o_h,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(q_starts_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(q_starts_ptr + seq).to(tl.int32)
    q_len = tl.load(q_starts_ptr + seq + 1).to(tl.int32) - q_start
    t0 = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first token of this tile within the chunk
    if t0 >= q_len:
        return
    ctx_len = tl.load(ctx_lens_ptr + seq).to(tl.int32)
    prefix = ctx_len - q_len

    rows = tl.arange(0, BLOCK_M)
    token = t0 + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    mask_m = (rows < BLOCK_Q * GROUP) & (token < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    flat = (q_start + token).to(tl.int64)
    q = tl.load(
        q_ptr + flat[:, None] * stride_q_t + heads[:, None] * stride_q_h + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    position = prefix + token  # [BLOCK_M] context position of each row

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = kv_ptr + kv_head.to(tl.int64) * stride_kv_h
    v_base = k_base + stride_kv_kv
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    kv_end = prefix + tl.minimum(t0 + BLOCK_Q, q_len)
    full_end = (prefix + t0 + 1) // BLOCK_N * BLOCK_N

    # Keys every row sees: no masks.
    for n0 in range(0, full_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        page = tl.load(table + offs_n // PAGE_SIZE).to(tl.int64)
        key = page * stride_kv_blk + (offs_n % PAGE_SIZE) * stride_kv_tok
        k = tl.load(k_base + key[:, None] + offs_d[None, :], mask=mask_d[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + key[:, None] + offs_d[None, :], mask=mask_d[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # The diagonal: causal mask. Every valid row sees key 0 of the first step here
    # (or already has a finite max), so no row's max stays -inf.
    for n0 in range(full_end, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        page = tl.load(table + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        key = page * stride_kv_blk + (offs_n % PAGE_SIZE) * stride_kv_tok
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_base + key[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        visible = (offs_n[None, :] <= position[:, None]) & mask_n[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + key[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + flat[:, None] * stride_o_t + heads[:, None] * stride_o_h + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def paged_prefill_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    block_tables: torch.Tensor,
    q_starts: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context.

    q [T, Hq, D] (last dim contiguous; rows of S sequences back to back),
    kv [2, NB, Hkv, BS, D] (head_dim contiguous; the chunk's K/V already written),
    block_tables [S, max_blocks] int32/int64, q_starts [S + 1] int32/int64 cumulative
    (q_starts[0] == 0, q_starts[S] == T; a sequence may have q_len 0),
    ctx_lens [S] int32/int64 (cached prefix + chunk, >= q_len), scale: softmax scale.
    Returns out [T, Hq, D] in q.dtype (written into `out` if given).

    block_m / block_n / num_warps / num_stages override the tiling (tests, tuning).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    check_kv(kv, head_dim)
    check_last_dim_contiguous("q", q)
    _, _, num_kv_heads, block_size, _ = kv.shape
    num_seqs = ctx_lens.shape[0]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if q_starts.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"q_starts {tuple(q_starts.shape)} / block_tables {tuple(block_tables.shape)} "
            f"do not match {num_seqs} sequences"
        )
    if out is None:
        out = torch.empty_like(q)
    check_last_dim_contiguous("out", out)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()

    group = num_q_heads // num_kv_heads
    block_d = max(16, next_power_of_2(head_dim))
    # Tuned on an H200 (bf16, 32 q / 8 kv heads): head_dim 64 -> 128 x 64 tiles, 8 warps,
    # 3 stages (190-350 TFLOP/s); head_dim 128 -> 64 x 64 tiles, 4 warps, 2 stages (200-400).
    wide = block_d > 64
    block_m = max(block_m or (64 if wide else 128), 16, next_power_of_2(group))
    block_q = block_m // group
    block_n = block_n or _BLOCK_N
    if num_warps is None:
        num_warps = 8 if block_m >= 128 else 4
    if num_stages is None:
        num_stages = 2 if wide else 3
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q,
        kv,
        block_tables,
        q_starts,
        ctx_lens,
        out,
        scale * LOG2_E,
        num_seqs,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        kv.stride(3),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE_SIZE=block_size,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
