"""Plain-torch references for the fused per-token kernels of a decoder layer
(`norm.py`, `rotary.py`, `activation.py`).

They spell out exactly the arithmetic the unfused model does (see
`engine/models/llama.py`): fp32 statistics, one rounding to the activation
dtype, then the weight multiply in the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (norm(x [+ residual]) * weight, x [+ residual]); the second is None
    when no residual is given."""
    if residual is not None:
        x = x + residual
        residual = x
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, residual


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by the half-split ("rotate_half") convention; cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate first) -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
