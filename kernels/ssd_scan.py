"""Mamba2 prefill: the chunked SSD scan of one sequence, carrying the [H, P, N] state.

    x [L, H, P]  dt [L, H]  A / D / dt_bias [H]  B / C [L, G, N]  initial state [H, P, N] | None
    -> y [L, H, P], final state [H, P, N] (fp32)

One program per (head, block of P channels) walks the chunks in order, keeping its
[BLOCK_P, N] state tile in registers (fp32). Per chunk of Q tokens (a = cumsum(dt' A)):

    y     = ((C Bᵀ) ∘ exp(a_l - a_s)[s ≤ l] ∘ dt'_s) x          intra-chunk, [Q, Q] @ [Q, BLOCK_P]
          + exp(a_l) (C hᵀ)                                      from the state entering the chunk
          + D x
    h     = exp(a_Q) h + (x ∘ exp(a_Q - a_s) dt'_s)ᵀ B           state leaving the chunk

Heads and P blocks run in parallel; chunks are sequential inside a program, so no
inter-chunk pass is needed. Q is the model's chunk size rounded up to a power of two
(>= 16, for `tl.dot`); the chunking changes rounding only, not the result.
Reference: `ssm_reference.ssd_chunk_scan_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, dot_precision, next_power_of_2
from .ssm_reference import ssd_chunk_scan_reference

__all__ = ["ssd_chunk_scan", "ssd_chunk_scan_reference"]


@triton.jit
def _softplus(v):
    return tl.where(v > 20.0, v, tl.log(1.0 + tl.exp(v)))


@triton.jit
def _chunk_scan_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dt_bias_ptr, init_ptr, y_ptr, final_ptr,
    length, dt_min,
    stride_x_l, stride_x_h,
    stride_dt_l,
    stride_b_l, stride_b_g,
    stride_c_l, stride_c_g,
    stride_y_l, stride_y_h,
    HAS_INIT: tl.constexpr,
    HEADS_PER_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STATE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    h = tl.program_id(0)
    pb = tl.program_id(1)
    g = h // HEADS_PER_GROUP
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    offs_q = tl.arange(0, BLOCK_Q)
    mask_p = offs_p < HEAD_DIM
    mask_n = offs_n < STATE
    tile = mask_p[:, None] & mask_n[None, :]
    state_offs = h * HEAD_DIM * STATE + offs_p[:, None] * STATE + offs_n[None, :]
    if HAS_INIT:
        s = tl.load(init_ptr + state_offs, mask=tile, other=0.0).to(tl.float32)
    else:
        s = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    a_h = tl.load(a_ptr + h).to(tl.float32)
    d_h = tl.load(d_ptr + h).to(tl.float32)
    bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    causal = offs_q[:, None] >= offs_q[None, :]
    for start in range(0, length, BLOCK_Q):
        rows = start + offs_q
        mask_l = rows < length
        dt = tl.load(dt_ptr + rows * stride_dt_l + h, mask=mask_l, other=0.0).to(tl.float32)
        step = tl.where(mask_l, tl.maximum(_softplus(dt + bias), dt_min), 0.0)  # padded steps: no decay, no input
        a = tl.cumsum(step * a_h, axis=0)  # [Q]
        a_last = tl.sum(step * a_h, axis=0)
        x = tl.load(x_ptr + rows[:, None] * stride_x_l + h * stride_x_h + offs_p[None, :],
                    mask=mask_l[:, None] & mask_p[None, :], other=0.0).to(tl.float32)  # [Q, BP]
        bm = tl.load(b_ptr + rows[:, None] * stride_b_l + g * stride_b_g + offs_n[None, :],
                     mask=mask_l[:, None] & mask_n[None, :], other=0.0).to(tl.float32)  # [Q, BN]
        cm = tl.load(c_ptr + rows[:, None] * stride_c_l + g * stride_c_g + offs_n[None, :],
                     mask=mask_l[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        scores = tl.dot(cm, tl.trans(bm), input_precision=PRECISION)  # [Q, Q]
        seg = tl.where(causal, a[:, None] - a[None, :], float("-inf"))
        scores = scores * tl.exp(seg) * step[None, :]
        y = tl.dot(scores, x, input_precision=PRECISION)  # [Q, BP]
        y += tl.exp(a)[:, None] * tl.dot(cm, tl.trans(s), input_precision=PRECISION)
        y += d_h * x
        tl.store(y_ptr + rows[:, None] * stride_y_l + h * stride_y_h + offs_p[None, :],
                 y.to(y_ptr.dtype.element_ty), mask=mask_l[:, None] & mask_p[None, :])
        w = tl.exp(a_last - a) * step  # [Q]
        s = tl.exp(a_last) * s + tl.dot(tl.trans(x * w[:, None]), bm, input_precision=PRECISION)
    tl.store(final_ptr + state_offs, s, mask=tile)


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor | None = None,
    dt_min: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring."""
    length, heads, head_dim = x.shape
    groups, n = B.shape[1], B.shape[2]
    if heads % groups:
        raise ValueError(f"{heads} heads cannot share {groups} B/C groups")
    for name, t in (("x", x), ("dt", dt), ("B", B), ("C", C)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    y = torch.empty_like(x)
    final = torch.empty(heads, head_dim, n, dtype=torch.float32, device=x.device)
    init = None
    if initial_state is not None:
        init = initial_state.float().contiguous()
        if init.shape != final.shape:
            raise ValueError(f"initial_state must be {tuple(final.shape)}, got {tuple(initial_state.shape)}")
    block_p = max(16, min(32, next_power_of_2(head_dim)))
    _chunk_scan_kernel[(heads, cdiv(head_dim, block_p))](
        x, dt, A, B, C, D, dt_bias, init if init is not None else final, y, final,
        length, float(dt_min),
        x.stride(0), x.stride(1),
        dt.stride(0),
        B.stride(0), B.stride(1),
        C.stride(0), C.stride(1),
        y.stride(0), y.stride(1),
        HAS_INIT=init is not None,
        HEADS_PER_GROUP=heads // groups,
        HEAD_DIM=head_dim,
        STATE=n,
        BLOCK_Q=max(16, next_power_of_2(chunk_size)),
        BLOCK_P=block_p,
        BLOCK_N=max(16, next_power_of_2(n)),
        PRECISION=dot_precision(x.dtype),
    )
    return y, final
