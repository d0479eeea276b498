"""SwiGLU activation of a fused gate/up projection: silu(gate) * up in one launch.

    gate_up [T, 2I] (gate columns first) -> out [T, I]

Rounded as the unfused `F.silu(gate) * up`: silu in fp32, rounded to the
activation dtype, then the product rounded again. Grid (T, I / BLOCK).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, check_last_dim_contiguous
from ._pdl import pdl_launch, wait_for_producer
from .elementwise_reference import silu_and_mul_reference

__all__ = ["silu_and_mul", "silu_and_mul_reference"]

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_producer(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + t * stride_x + inter + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + t * stride_out + offs, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2 * I], got {tuple(gate_up.shape)}")
    check_last_dim_contiguous("gate_up", gate_up)
    num_tokens, width = gate_up.shape
    inter = width // 2
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    block = min(_BLOCK, 1 << max(0, (inter - 1).bit_length()))
    _silu_and_mul_kernel[(num_tokens, cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4, **pdl_launch(gate_up.device)
    )
    return out
