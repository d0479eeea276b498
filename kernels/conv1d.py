"""Mamba2's causal depthwise conv (+ SiLU) over the carried conv state, in Triton.

    decode   x [Bt, C], conv_state [S, C, K-1] at rows `slots` [Bt], weight [C, K], bias [C] | None
             y[b, c] = silu(bias[c] + sum_j w[c, j] * xx[b, c, j])   xx = state[slot, c] ++ x[b, c]
             state[slot, c] <- xx[b, c, 1:]                          (in place)
    prefill  x [L, C] of one sequence, its conv_state [C, K-1] (read only)
             y[t, c] = silu(bias[c] + sum_j w[c, j] * xx[c, t + j])  xx = state[c] ++ x[:, c]
             new state = xx[c, L:] (the last K-1 inputs), returned

One program per (row or block of rows, block of channels): the K taps (4 in the Mamba2
checkpoints) are a static loop, so each input is read once per tap from cache, accumulated in
fp32. Replaces the references' gather / cat / multiply / sum / SiLU / scatter (six launches a
layer in a decode step) with one. References: `ssm_reference.causal_conv1d_update_reference`,
`causal_conv1d_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, next_power_of_2
from .ssm_reference import causal_conv1d_reference, causal_conv1d_update_reference

__all__ = ["causal_conv1d", "causal_conv1d_reference", "causal_conv1d_update", "causal_conv1d_update_reference"]

BLOCK_C = 128
BLOCK_L = 16


@triton.jit
def _silu(v):
    return v / (1.0 + tl.exp(-v))


@triton.jit
def _conv_update_kernel(
    x_ptr, state_ptr, w_ptr, bias_ptr, slots_ptr, y_ptr,
    channels,
    stride_x_b, stride_s_slot, stride_s_c, stride_w_c, stride_y_b,
    TAPS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < channels
    slot = tl.load(slots_ptr + b)
    row = state_ptr + slot * stride_s_slot + offs * stride_s_c
    x = tl.load(x_ptr + b * stride_x_b + offs, mask=mask, other=0.0).to(tl.float32)
    acc = x * tl.load(w_ptr + offs * stride_w_c + (TAPS - 1), mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(TAPS - 1):
        s = tl.load(row + j, mask=mask, other=0.0)
        acc += s.to(tl.float32) * tl.load(w_ptr + offs * stride_w_c + j, mask=mask, other=0.0).to(tl.float32)
        if j > 0:  # shift left: the state keeps the last K-1 inputs
            tl.store(row + (j - 1), s, mask=mask)
    tl.store(row + (TAPS - 2), x.to(state_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + b * stride_y_b + offs, _silu(acc).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _conv_kernel(
    x_ptr, state_ptr, w_ptr, bias_ptr, y_ptr,
    length, channels,
    stride_x_t, stride_s_c, stride_w_c, stride_y_t,
    TAPS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask_t, mask_c = offs_t < length, offs_c < channels
    acc = tl.zeros((BLOCK_T, BLOCK), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(TAPS):
        src = offs_t + (j - (TAPS - 1))  # input index; negative: the carried state's column K-1+src
        in_x = (src >= 0)[:, None] & mask_t[:, None] & mask_c[None, :]
        in_state = (src < 0)[:, None] & mask_t[:, None] & mask_c[None, :]
        v = tl.load(x_ptr + src[:, None] * stride_x_t + offs_c[None, :], mask=in_x, other=0.0).to(tl.float32)
        col = src + (TAPS - 1)
        v += tl.load(state_ptr + offs_c[None, :] * stride_s_c + col[:, None], mask=in_state, other=0.0).to(tl.float32)
        acc += v * tl.load(w_ptr + offs_c * stride_w_c + j, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_t[:, None] * stride_y_t + offs_c[None, :]
    tl.store(y_ptrs, _silu(acc).to(y_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_c[None, :])


def _check(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> int:
    channels, taps = weight.shape
    if taps < 2:
        raise ValueError(f"the conv needs at least 2 taps, got a weight of shape {tuple(weight.shape)}")
    if x.shape[-1] != channels or state.shape[-2:] != (channels, taps - 1) or state.stride(-1) != 1:
        raise ValueError(f"x [..., {channels}] and a conv state [..., {channels}, {taps - 1}] contiguous in its last "
                         f"dim needed, got x {tuple(x.shape)}, state {tuple(state.shape)}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"x and the weight must be contiguous in their last dim, got strides {x.stride()}, "
                         f"{weight.stride()}")
    return taps


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         slots: torch.Tensor) -> torch.Tensor:
    """Decode (see the module docstring): y [Bt, C] in x.dtype; `conv_state` rows updated in place."""
    taps = _check(x, weight, conv_state)
    y = torch.empty_like(x)
    if x.shape[0] == 0:
        return y
    block = min(BLOCK_C, next_power_of_2(x.shape[1]))
    _conv_update_kernel[(x.shape[0], cdiv(x.shape[1], block))](
        x, conv_state, weight, bias if bias is not None else weight, slots, y,
        x.shape[1],
        x.stride(0), conv_state.stride(0), conv_state.stride(1), weight.stride(0), y.stride(0),
        TAPS=taps, HAS_BIAS=bias is not None, BLOCK=block,
    )
    return y


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill of one sequence (see the module docstring): (y [L, C] in x.dtype, the new conv state
    [C, K-1] in conv_state.dtype, a new tensor: `conv_state` is only read)."""
    taps = _check(x, weight, conv_state)
    length, channels = x.shape
    y = torch.empty_like(x)
    keep = taps - 1
    if length >= keep:
        new_state = x[length - keep:].t().to(conv_state.dtype).contiguous()
    else:
        new_state = torch.cat([conv_state[:, length:], x.t().to(conv_state.dtype)], dim=1)
    if length == 0:
        return y, new_state
    block = min(BLOCK_C, next_power_of_2(channels))
    _conv_kernel[(cdiv(length, BLOCK_L), cdiv(channels, block))](
        x, conv_state, weight, bias if bias is not None else weight, y,
        length, channels,
        x.stride(0), conv_state.stride(0), weight.stride(0), y.stride(0),
        TAPS=taps, HAS_BIAS=bias is not None, BLOCK_T=BLOCK_L, BLOCK=block,
    )
    return y, new_state
