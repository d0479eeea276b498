"""Mamba2 decode: one recurrent step per sequence, on the state at its slot, in place.

    state [S, H, P, N]  x [Bt, H, P]  dt [Bt, H]  A / D / dt_bias [H]  B / C [Bt, G, N]  slots [Bt]

    dt' = max(softplus(dt + dt_bias), dt_min)
    state[slot, h] = exp(dt' A[h]) state[slot, h] + dt' x[b, h] ⊗ B[b, h // (H / G)]
    y[b, h]        = state[slot, h] · C[b, h // (H / G)] + D[h] x[b, h]

One program per (sequence, head, block of P rows) holds a [BLOCK_P, N] tile of the
state in registers, in fp32. Reference: `ssm_reference.selective_state_update_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, next_power_of_2
from .ssm_reference import selective_state_update_reference

__all__ = ["selective_state_update", "selective_state_update_reference"]


@triton.jit
def _softplus(v):
    return tl.where(v > 20.0, v, tl.log(1.0 + tl.exp(v)))


@triton.jit
def _state_update_kernel(
    state_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dt_bias_ptr, slots_ptr, y_ptr,
    dt_min,
    stride_s_slot, stride_s_h, stride_s_p,
    stride_x_b, stride_x_h,
    stride_dt_b,
    stride_b_b, stride_b_g,
    stride_c_b, stride_c_g,
    stride_y_b, stride_y_h,
    HEADS_PER_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STATE: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    g = h // HEADS_PER_GROUP
    slot = tl.load(slots_ptr + b)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < HEAD_DIM
    mask_n = offs_n < STATE
    tile = mask_p[:, None] & mask_n[None, :]
    s_ptrs = state_ptr + slot * stride_s_slot + h * stride_s_h + offs_p[:, None] * stride_s_p + offs_n[None, :]
    s = tl.load(s_ptrs, mask=tile, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + b * stride_x_b + h * stride_x_h + offs_p, mask=mask_p, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + b * stride_dt_b + h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
    step = tl.maximum(_softplus(dt), dt_min)
    decay = tl.exp(step * tl.load(a_ptr + h).to(tl.float32))
    bv = tl.load(b_ptr + b * stride_b_b + g * stride_b_g + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    cv = tl.load(c_ptr + b * stride_c_b + g * stride_c_g + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    s = s * decay + (step * x)[:, None] * bv[None, :]
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=tile)
    y = tl.sum(s * cv[None, :], axis=1) + tl.load(d_ptr + h).to(tl.float32) * x
    tl.store(y_ptr + b * stride_y_b + h * stride_y_h + offs_p, y.to(y_ptr.dtype.element_ty), mask=mask_p)


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    slots: torch.Tensor,
    dt_min: float = 0.0,
) -> torch.Tensor:
    """See the module docstring; returns y [Bt, H, P] in x.dtype, updates `state` in place."""
    batch, heads, head_dim = x.shape
    groups, n = B.shape[1], B.shape[2]
    if state.shape[1:] != (heads, head_dim, n) or state.stride(-1) != 1:
        raise ValueError(f"state must be [S, {heads}, {head_dim}, {n}] contiguous in N, got {tuple(state.shape)}")
    if heads % groups:
        raise ValueError(f"{heads} heads cannot share {groups} B/C groups")
    for name, t in (("x", x), ("B", B), ("C", C)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    y = torch.empty_like(x)
    if batch == 0:
        return y
    block_p = min(32, next_power_of_2(head_dim))
    grid = (batch, heads, cdiv(head_dim, block_p))
    _state_update_kernel[grid](
        state, x, dt, A, B, C, D, dt_bias, slots, y,
        float(dt_min),
        state.stride(0), state.stride(1), state.stride(2),
        x.stride(0), x.stride(1),
        dt.stride(0),
        B.stride(0), B.stride(1),
        C.stride(0), C.stride(1),
        y.stride(0), y.stride(1),
        HEADS_PER_GROUP=heads // groups,
        HEAD_DIM=head_dim,
        STATE=n,
        BLOCK_P=block_p,
        BLOCK_N=next_power_of_2(n),
    )
    return y
