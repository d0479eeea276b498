"""The decode step's qkv projection with rotary and the KV write in its epilogue: one launch.

    x [T, K], weight [(Hq + 2 Hk) * D, K] (q, k, v heads' rows), cos / sin [T, D]
    (or tables [P, D] and positions [T]: the rows gathered in the kernel)
    -> q [T, Hq, D] rotated; k rotated and v written into kv [2, NB, Hk, BS, D] at each
       row's slot (a negative slot, a padding row, is not written)

At decode sizes the projection (`kernels.linear`) streams its weight once for a few rows, and
rotary + the KV write (`kernels.rotary`) was a launch of its own per layer reading the qkv
result back (~37 µs a step of a batch-64 Llama-3.2-1B graph on an H200). Here a program
takes BLOCK_P rotary pairs — dim j of a head and dim j + D/2 of the same head: its weight
tile is those pairs' first-half rows then their second-half rows — so both inputs of every
rotated output are in its registers. v heads take the same path with cos 1, sin 0 (exact:
x * 1 + (-y * 0) is x). Roundings are the unfused ones: the projection rounded to the
activation dtype, each rotary product and the sum rounded as `kernels.rotary` rounds them,
so fp32 is that pair's result bit for bit up to the projection's summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, check_kv, check_last_dim_contiguous, dot_precision, next_power_of_2
from ._pdl import pdl_launch, wait_for_producer
from .linear import MAX_ROWS, LinearConfig, RowNorm, check_row_norm, parts_block
from .weight_stream import rows_rstd, split_halves, stream_weight_tile

__all__ = ["decode_qkv_rotary"]


@triton.jit
def _rotary_rows(cos_ptr, sin_ptr, cs, cs_mask, HALF: tl.constexpr):
    """fp32 (cos, cos + HALF, sin, sin + HALF) at offsets `cs` (masked: cos 1, sin 0)."""
    c1 = tl.load(cos_ptr + cs, mask=cs_mask, other=1.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cs + HALF, mask=cs_mask, other=1.0).to(tl.float32)
    s1 = tl.load(sin_ptr + cs, mask=cs_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + cs + HALF, mask=cs_mask, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def _qkv_rotary_kernel(
    x_ptr, w_ptr, q_ptr, kv_ptr, slot_ptr, cos_ptr, sin_ptr, pos_ptr, sq_ptr,
    M, stride_xm, stride_wn, stride_qm, stride_qh, stride_cs, stride_sq, eps,
    stride_kv_kv, stride_kv_blk, stride_kv_h, stride_kv_tok,
    NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HALF: tl.constexpr, PAGE_SIZE: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    NORM: tl.constexpr, PARTS: tl.constexpr, PARTS_BLOCK: tl.constexpr, GATHER: tl.constexpr, PDL: tl.constexpr,
):
    """NORM: the sums are of x's RMSNorm, its weight folded into w (`kernels.linear.RowNorm`):
    rows scaled by 1 / rms from PARTS partial sums of squares at sq_ptr before the rotary.
    GATHER: cos / sin are tables by position, row m's at pos_ptr[m]."""
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    pairs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_p = pairs < (NUM_Q + 2 * NUM_KV) * HALF
    head = pairs // HALF  # q heads, then k heads, then v heads
    dim = pairs % HALF
    is_q = head < NUM_Q
    is_v = head >= NUM_Q + NUM_KV
    # The epilogue's inputs are loaded before the weight stream, their latency hidden under it;
    # positions, slots (a step's inputs, copied before its first kernel) and the rotary tables
    # (constant) before the PDL wait too: the kernel this one may overlap (the one before it, which
    # signalled only after its own wait, kernels/_pdl.py) writes none of them. Gathered by position,
    # the cos / sin loads follow the positions' load: after the wait that second DRAM latency
    # delayed the weight stream (batch-1 replay 0.17% slower than with torch's rows; before it
    # 0.10%, and batch 64 0.3% faster than with them: H100, benchmarks/RESULTS.md session 32).
    # Rows passed in (not GATHER) may be the previous kernel's output (torch's gather runs right
    # before the first layer's qkv): loaded after the wait.
    cs_mask = mask_m[:, None] & (mask_p & ~is_v)[None, :]  # v heads: cos 1, sin 0
    slot = tl.load(slot_ptr + offs_m, mask=mask_m, other=-1).to(tl.int64)
    if GATHER:
        cs_rows = tl.load(pos_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
        c1, c2, s1, s2 = _rotary_rows(cos_ptr, sin_ptr, cs_rows[:, None] * stride_cs + dim[None, :], cs_mask, HALF)
    # One tile of 2 * BLOCK_P weight rows: the pairs' first-half rows, then their second-half
    # rows (two tiles of BLOCK_P rows, streamed as a pair, were ~1 µs a layer slower on an H200).
    r = tl.arange(0, 2 * BLOCK_P)
    tile_pairs = tl.program_id(0) * BLOCK_P + r % BLOCK_P
    tile_rows = (tile_pairs // HALF) * 2 * HALF + tile_pairs % HALF + (r // BLOCK_P) * HALF
    rows = w_ptr + tile_rows.to(tl.int64)[:, None] * stride_wn
    wait_for_producer(PDL)  # x is the previous kernel's
    if not GATHER:
        c1, c2, s1, s2 = _rotary_rows(cos_ptr, sin_ptr, offs_m[:, None] * stride_cs + dim[None, :], cs_mask, HALF)
    acc = stream_weight_tile(x_ptr + offs_m[:, None] * stride_xm, rows, 0, mask_m,
                             tile_pairs < (NUM_Q + 2 * NUM_KV) * HALF, 0, K, BLOCK_M, 2 * BLOCK_P, BLOCK_K,
                             DOT_PRECISION, False)  # waited for the producer above
    if NORM:
        acc = acc * rows_rstd(sq_ptr, offs_m, mask_m, stride_sq, eps, K, PARTS, PARTS_BLOCK)[:, None]
    acc_lo, acc_hi = split_halves(acc, BLOCK_M, BLOCK_P)
    dtype = q_ptr.dtype.element_ty
    a1 = acc_lo.to(dtype).to(tl.float32)
    a2 = acc_hi.to(dtype).to(tl.float32)
    lo = ((a1 * c1).to(dtype).to(tl.float32) + (-a2 * s1).to(dtype).to(tl.float32)).to(dtype)
    hi = ((a2 * c2).to(dtype).to(tl.float32) + (a1 * s2).to(dtype).to(tl.float32)).to(dtype)

    q_out = q_ptr + offs_m[:, None] * stride_qm + head[None, :] * stride_qh + dim[None, :]
    q_mask = mask_m[:, None] & (mask_p & is_q)[None, :]
    tl.store(q_out, lo, mask=q_mask)
    tl.store(q_out + HALF, hi, mask=q_mask)

    kv_head = tl.where(is_v, head - NUM_Q - NUM_KV, head - NUM_Q)
    cache = (kv_ptr + is_v.to(tl.int64)[None, :] * stride_kv_kv
             + ((slot // PAGE_SIZE) * stride_kv_blk + (slot % PAGE_SIZE) * stride_kv_tok)[:, None]
             + kv_head[None, :] * stride_kv_h + dim[None, :])
    kv_mask = (mask_m & (slot >= 0))[:, None] & (mask_p & ~is_q)[None, :]
    ty = kv_ptr.dtype.element_ty
    tl.store(cache, lo.to(ty), mask=kv_mask)
    tl.store(cache + HALF, hi.to(ty), mask=kv_mask)


def decode_qkv_rotary(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    kv: torch.Tensor, slot_mapping: torch.Tensor, num_q_heads: int, config: LinearConfig | None = None,
    norm: RowNorm | None = None, positions: torch.Tensor | None = None, signal_early: bool = True,
) -> torch.Tensor:
    """q [T, Hq, D] of x [T, K] (T <= MAX_ROWS) through the fused qkv weight, rotated, with the
    rotated k and the v of every row written into kv at slot_mapping [T]: what
    `decode_linear` then `apply_rotary_qk_and_write_kv` compute, in one launch. `config`
    (unsplit) as for the qkv projection: a program reads block_n // 2 pairs of weight rows.
    `norm`: x is the residual stream a `decode_linear_add` just wrote and the projection is of
    its RMSNorm, γ folded into `weight` (`kernels.RowNorm`): the norm takes no launch.
    `positions` (integer [T]): cos and sin are tables [P, head_dim] of every position (views with
    one row stride, `RotaryEmbedding.tables`) and each row's are gathered in the kernel — no
    gather launch of torch's a step; positions must be < P. `signal_early=False`: the next kernel
    (the decode attention) is launched as ours exits, not early under PDL (`_pdl.pdl_launch`)."""
    rows, k = x.shape if x.dim() == 2 else (-1, -1)
    check_kv(kv, kv.shape[-1] if kv.dim() == 5 else 0)
    head_dim, num_kv = kv.shape[4], kv.shape[2]
    if x.dim() != 2 or weight.dim() != 2 or weight.shape != ((num_q_heads + 2 * num_kv) * head_dim, k):
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit "
                         f"{num_q_heads} q and {num_kv} kv heads of {head_dim}")
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} must be even")
    if rows > MAX_ROWS:
        raise ValueError(f"decode_qkv_rotary() takes at most {MAX_ROWS} rows, got {rows}")
    cs_rows = cos.shape[0] if positions is not None and cos.dim() == 2 else rows
    if cos.shape != (cs_rows, head_dim) or sin.shape != cos.shape or cos.stride(0) != sin.stride(0):
        raise ValueError(f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} must be [{rows if positions is None else 'P'}, "
                         f"{head_dim}], one row stride")
    if positions is not None and (positions.shape != (rows,) or positions.dtype.is_floating_point):
        raise ValueError(f"positions must be integer [{rows}], got {tuple(positions.shape)} {positions.dtype}")
    if slot_mapping.shape != (rows,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} must be [{rows}]")
    if config is not None and config.splits != 1:
        raise ValueError("decode_qkv_rotary() takes an unsplit config: rotary of partial sums is not theirs")
    check_row_norm(norm, rows)
    for name, t in (("x", x), ("weight", weight), ("cos", cos), ("sin", sin)):
        check_last_dim_contiguous(name, t)
    q = torch.empty(rows, num_q_heads, head_dim, dtype=x.dtype, device=x.device)
    if rows == 0:
        return q
    if config is None:
        config = LinearConfig() if x.element_size() <= 2 else LinearConfig(block_k=64, num_stages=2)
    block_n, block_k, num_warps, num_stages, _ = config
    block_p = max(8, block_n // 2)
    half = head_dim // 2
    _qkv_rotary_kernel[(cdiv((num_q_heads + 2 * num_kv) * half, block_p),)](
        x, weight, q, kv, slot_mapping, cos, sin, positions if positions is not None else slot_mapping,
        norm.squares if norm else x,
        rows, x.stride(0), weight.stride(0), q.stride(0), q.stride(1), cos.stride(0),
        norm.squares.stride(0) if norm else 0, norm.eps if norm else 0.0,
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        NUM_Q=num_q_heads, NUM_KV=num_kv, HALF=half, PAGE_SIZE=kv.shape[3], K=k,
        BLOCK_M=max(16, next_power_of_2(rows)), BLOCK_P=block_p, BLOCK_K=min(block_k, max(16, next_power_of_2(k))),
        DOT_PRECISION=dot_precision(x.dtype), NORM=norm is not None,
        PARTS=norm.squares.shape[0] if norm else 1, PARTS_BLOCK=parts_block(norm), GATHER=positions is not None,
        num_warps=num_warps, num_stages=num_stages,
        **pdl_launch(x.device, signal_early),
    )
    return q
