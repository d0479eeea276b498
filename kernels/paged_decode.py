"""Paged decode attention (one query token per sequence), flash-decoding style.

    q [B, Hq, D], kv [2, NB, Hkv, BS, D], block_tables [B, max_blocks], ctx_lens [B]
        -> out [B, Hq, D]

Two launches:

    stage 1, grid (B, Hkv, P): program (b, g, p) takes the GROUP = Hq / Hkv query
    heads of kv head g and the context slice [p * PART, (p + 1) * PART) of
    sequence b; K/V of that slice are read once for the whole group.

        context  |--- part 0 ---|--- part 1 ---|--- part 2 ---|..   (PART tokens each)
        tiles    |BN|BN|BN|BN|..                                    (BLOCK_N tokens per step,
                                                                     gathered across pages)
        -> partial_out [B, Hq, P, D] (normalised), partial_lse [B, Hq, P] (log2 domain)

    stage 2, grid (B, Hq): merges the valid partials by their log-sum-exp.

When P == 1 stage 1 writes the output directly and stage 2 is skipped.

P and PART come from shapes (batch, kv heads, max_blocks * block_size) and the
device's multiprocessor count, never from tensor values: no host sync, and the
workspace size is fixed for fixed shapes, so the call can be captured in a CUDA
graph. Partitions past a sequence's context exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LOG2_E, check_kv, check_last_dim_contiguous, dot_precision, next_power_of_2
from ._pdl import pdl_launch, pdl_mode, wait_for_producer
from .decode_plan import DecodePlan, DecodeWorkspace, plan_decode
from .reference import paged_decode_reference

__all__ = ["DecodePlan", "DecodeWorkspace", "decode_attention_unsplit", "paged_decode_attention", "paged_decode_reference",
           "plan_decode"]


@triton.jit
def _decode_partition_kernel(
    q_ptr,
    kv_ptr,
    block_tables_ptr,
    ctx_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    stride_q_b,
    stride_q_h,
    stride_kv_kv,
    stride_kv_blk,
    stride_kv_h,
    stride_kv_tok,
    stride_bt_b,
    stride_o_b,
    stride_o_h,
    num_q_heads,
    num_partitions,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    IS_SINGLE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producer(PDL)
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    ctx_len = tl.load(ctx_lens_ptr + b).to(tl.int32)
    start = part * PARTITION_SIZE
    if not IS_SINGLE:
        if start >= ctx_len:
            return
    end = tl.minimum(start + PARTITION_SIZE, ctx_len)

    offs_h = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_h
    mask_h = offs_h < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_q_b + heads[:, None] * stride_q_h + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    k_base = kv_ptr + kv_head.to(tl.int64) * stride_kv_h
    v_base = k_base + stride_kv_kv
    table = block_tables_ptr + b * stride_bt_b
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(table + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        token = page * stride_kv_blk + (offs_n % PAGE_SIZE) * stride_kv_tok  # [BLOCK_N]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_base + token[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_H, BLOCK_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + token[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = mask_h[:, None] & mask_d[None, :]
    if IS_SINGLE:
        # ctx_len 0 (a padded row) never entered the loop: l_i == 0 -> zeros.
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(
            out_ptr + b * stride_o_b + heads[:, None] * stride_o_h + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        o = acc / l_i[:, None]
        row = (b * num_q_heads + heads) * num_partitions + part  # [BLOCK_H] index into [B, Hq, P]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=out_mask)
        tl.store(part_lse_ptr + row, m_i + tl.log2(l_i), mask=mask_h)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    ctx_lens_ptr,
    out_ptr,
    stride_o_b,
    stride_o_h,
    num_q_heads,
    num_partitions,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_producer(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    ctx_len = tl.load(ctx_lens_ptr + b).to(tl.int32)
    num_valid = tl.cdiv(ctx_len, PARTITION_SIZE)
    base = (b * num_q_heads + h) * num_partitions
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    # Pass 1: the largest log-sum-exp. Pass 2: weights relative to it.
    m = tl.full([BLOCK_P], float("-inf"), tl.float32)
    for p0 in range(0, num_valid, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        lse = tl.load(part_lse_ptr + base + offs_p, mask=offs_p < num_valid, other=float("-inf"))
        m = tl.maximum(m, lse)
    m_max = tl.max(m, 0)

    acc = tl.zeros([BLOCK_D], tl.float32)
    denom = tl.zeros([BLOCK_P], tl.float32)
    for p0 in range(0, num_valid, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        mask_p = offs_p < num_valid
        lse = tl.load(part_lse_ptr + base + offs_p, mask=mask_p, other=float("-inf"))
        w = tl.where(mask_p, tl.exp2(lse - m_max), 0.0)
        o = tl.load(
            part_out_ptr + (base + offs_p)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=mask_p[:, None] & mask_d[None, :],
            other=0.0,
        )
        acc += tl.sum(w[:, None] * o, 0)
        denom += w
    total = tl.sum(denom, 0)
    o = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b * stride_o_b + h * stride_o_h + offs_d, o.to(out_ptr.dtype.element_ty), mask=mask_d)


def decode_attention_unsplit(batch: int, kv: torch.Tensor, max_blocks: int) -> bool:
    """Whether `paged_decode_attention` of `batch` sequences over `kv` [2, NB, Hkv, BS, D] with
    block tables `max_blocks` wide runs unsplit (one stage-1 launch, one program per sequence
    and kv head, no reduce). Off CUDA (no PDL to steer) always False, at no cost."""
    if pdl_mode(kv.device) < 2:
        return False
    return plan_decode(batch, kv.shape[2], max_blocks, kv.shape[3], kv.device).num_partitions == 1


def paged_decode_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
    plan: DecodePlan | None = None,
    num_warps: int | None = None,
    num_stages: int = 3,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context.

    q [B, Hq, D] (last dim contiguous), kv [2, NB, Hkv, BS, D] (head_dim contiguous),
    block_tables [B, max_blocks] int32/int64 (rows padded with any valid block id;
    entries past the context are never read), ctx_lens [B] int32/int64 (tokens
    including the new one, whose K/V must already be written; 0 gives zeros),
    scale: softmax scale. Returns out [B, Hq, D] in q.dtype (written into `out`
    if given). fp32 accumulation; fp32 inputs use IEEE (not tf32) dot products.

    No host syncs and no value-dependent allocation: capturable in a CUDA graph.
    `plan` and `workspace` default to `plan_decode(...)` and a fresh allocation;
    pass both (built with the same shapes) to reuse one workspace across calls.
    num_warps / num_stages override the tuned launch settings.
    """
    batch, num_q_heads, head_dim = q.shape
    check_kv(kv, head_dim)
    check_last_dim_contiguous("q", q)
    _, _, num_kv_heads, block_size, _ = kv.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.shape[0] != batch or ctx_lens.shape != (batch,):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} / ctx_lens {tuple(ctx_lens.shape)} do not match batch {batch}"
        )
    if out is None:
        out = torch.empty_like(q)
    check_last_dim_contiguous("out", out)
    if batch == 0:
        return out
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    if plan is None:
        plan = plan_decode(batch, num_kv_heads, block_tables.shape[1], block_size, q.device)
    group = num_q_heads // num_kv_heads
    block_h = max(16, next_power_of_2(group))
    block_d = max(16, next_power_of_2(head_dim))
    is_single = plan.num_partitions == 1
    if num_warps is None:
        # 2 warps beat 4 by ~30% at batch 64 x 8k on an H200 (more programs resident);
        # the 128-token steps of unsplit plans (decode_plan.py) want 4.
        num_warps = 2 if block_d <= 128 and plan.block_n < 128 else 4
    if is_single:
        part_out = part_lse = out  # unused
    else:
        if workspace is None:
            workspace = DecodeWorkspace.allocate(batch, num_q_heads, head_dim, plan, q.device)
        part_out, part_lse = workspace.partial_out, workspace.partial_lse
        expected = (batch, num_q_heads, plan.num_partitions, head_dim)
        if tuple(part_out.shape) != expected or not part_out.is_contiguous() or not part_lse.is_contiguous():
            raise ValueError(f"workspace partial_out {tuple(part_out.shape)} does not fit {expected}")

    pdl = pdl_launch(q.device)
    _decode_partition_kernel[(batch, num_kv_heads, plan.num_partitions)](
        q,
        kv,
        block_tables,
        ctx_lens,
        out,
        part_out,
        part_lse,
        scale * LOG2_E,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        kv.stride(3),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        num_q_heads,
        plan.num_partitions,
        GROUP=group,
        BLOCK_H=block_h,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE_SIZE=block_size,
        BLOCK_N=plan.block_n,
        PARTITION_SIZE=plan.partition_size,
        IS_SINGLE=is_single,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
        # Under PDL like every kernel here. Whether the programs are launched early, while the
        # kernel before still runs, is that kernel's choice: an unsplit plan's 96 KB programs held
        # multiprocessors and waited (benchmarks/RESULTS.md 2026-12-05), so our qkv kernel signals
        # at its exit before them and before small batches' split plans
        # (engine/models/fused.py::_attention_launched_early, session 33).
        **pdl,
    )
    if not is_single:
        _decode_reduce_kernel[(batch, num_q_heads)](
            part_out,
            part_lse,
            ctx_lens,
            out,
            out.stride(0),
            out.stride(1),
            num_q_heads,
            plan.num_partitions,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            PARTITION_SIZE=plan.partition_size,
            BLOCK_P=min(64, next_power_of_2(plan.num_partitions)),
            num_warps=4,
            **pdl,
        )
    return out
