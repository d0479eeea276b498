"""Plain-torch references for the Mamba2 (SSD) kernels: the causal depthwise conv,
the recurrent single-step state update (decode) and the chunked scan (prefill).

They compute in fp32 and return the input dtype; the engine uses them as its CPU
path, and tests/kernels compare the Triton kernels against them.

Shapes (H heads of P channels, G groups of N state channels, K conv taps):

    x [L, H, P]   dt [L, H] (raw, before dt_bias / softplus)   A [H] (negative)
    B, C [L, G, N]   D [H]   head h reads group h // (H // G)
    ssm state [H, P, N]      conv state [C, K - 1]: the last K - 1 conv inputs, oldest first

The recurrence, per head, after dt' = max(softplus(dt + dt_bias), dt_min):

    h_t = exp(dt'_t A) h_{t-1} + dt'_t x_t ⊗ B_t          y_t = h_t · C_t + D x_t
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def process_dt(dt: torch.Tensor, dt_bias: torch.Tensor, dt_min: float) -> torch.Tensor:
    """Raw dt [..., H] -> fp32 step sizes: softplus(dt + dt_bias), clamped below at dt_min."""
    return F.softplus(dt.float() + dt_bias.float()).clamp(min=dt_min)


def causal_conv1d_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's conv with its carried state, then SiLU.

    x [L, C], weight [C, K], bias [C] | None, conv_state [C, K - 1]
    -> y [L, C] (x.dtype), new conv state [C, K - 1] (conv_state.dtype).
    """
    length, channels = x.shape
    taps = weight.shape[-1]
    xx = torch.cat([conv_state.float(), x.float().t()], dim=1)  # [C, K - 1 + L]
    y = F.conv1d(xx[None], weight.float()[:, None, :], None if bias is None else bias.float(), groups=channels)[0]
    new_state = xx[:, xx.shape[1] - (taps - 1) :]
    return F.silu(y).t().contiguous().to(x.dtype), new_state.to(conv_state.dtype)


def causal_conv1d_update_reference(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, slots: torch.Tensor
) -> torch.Tensor:
    """One new input per sequence (decode). x [B, C]; conv_state [S, C, K - 1] is
    updated in place at rows `slots` [B] -> y [B, C] (SiLU applied)."""
    xx = torch.cat([conv_state[slots].float(), x.float()[:, :, None]], dim=2)  # [B, C, K]
    y = (xx * weight.float()[None]).sum(-1)
    if bias is not None:
        y = y + bias.float()
    conv_state[slots] = xx[:, :, 1:].to(conv_state.dtype)
    return F.silu(y).to(x.dtype)


def _heads(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: each group serves H // G consecutive heads."""
    return t.repeat_interleave(num_heads // t.shape[-2], dim=-2)


def selective_state_update_reference(
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
    """One recurrent step per sequence (decode).

    state [S, H, P, N] (updated in place at rows `slots` [Bt]), x [Bt, H, P], dt [Bt, H],
    A / D / dt_bias [H], B / C [Bt, G, N] -> y [Bt, H, P] (x.dtype).
    """
    num_heads = x.shape[1]
    step = process_dt(dt, dt_bias, dt_min)  # [Bt, H]
    decay = torch.exp(step * A.float())  # [Bt, H]
    b, c = _heads(B.float(), num_heads), _heads(C.float(), num_heads)  # [Bt, H, N]
    xf = x.float()
    h = state[slots].float() * decay[:, :, None, None] + (step[:, :, None] * xf)[..., None] * b[:, :, None, :]
    state[slots] = h.to(state.dtype)
    y = (h * c[:, :, None, :]).sum(-1) + D.float()[None, :, None] * xf
    return y.to(x.dtype)


def ssd_chunk_scan_reference(
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
    """The chunked SSD scan of one sequence.

    Within a chunk the output is a masked "attention" of C against B weighted by the
    decays; across chunks only the [H, P, N] state is carried:

        chunk c:  a_l = cumsum(dt' A) over the chunk
                  y_l = Σ_{s≤l} exp(a_l - a_s) (C_l·B_s) dt'_s x_s  +  exp(a_l) C_l·h_in  +  D x_l
                  h_out = exp(a_last) h_in + Σ_s exp(a_last - a_s) dt'_s x_s ⊗ B_s

    x [L, H, P], dt [L, H], B / C [L, G, N], initial_state [H, P, N] | None (zeros)
    -> y [L, H, P] (x.dtype), final state [H, P, N] (fp32).
    """
    length, num_heads, head_dim = x.shape
    q = chunk_size
    pad = (-length) % q
    step = process_dt(dt, dt_bias, dt_min)  # [L, H]
    xf, b, c = x.float(), _heads(B.float(), num_heads), _heads(C.float(), num_heads)
    if pad:  # padded steps: dt' = 0 -> no decay, no input; the final state is unchanged
        step = F.pad(step, (0, 0, 0, pad))
        xf, b, c = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (xf, b, c))
    nc = (length + pad) // q
    step = step.view(nc, q, num_heads)
    xf, b, c = (t.view(nc, q, num_heads, -1) for t in (xf, b, c))
    a = torch.cumsum(step * A.float(), dim=1)  # [nc, Q, H]
    seg = a[:, :, None, :] - a[:, None, :, :]  # [nc, l, s, H]
    causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp(seg.masked_fill(~causal[None, :, :, None], float("-inf")))
    scores = torch.einsum("clhn,cshn->clsh", c, b) * decay * step[:, None, :, :]
    y = torch.einsum("clsh,cshp->clhp", scores, xf)
    to_end = torch.exp(a[:, -1:, :] - a) * step  # [nc, Q, H]
    chunk_states = torch.einsum("clh,clhp,clhn->chpn", to_end, xf, b)
    h = torch.zeros(num_heads, head_dim, b.shape[-1], dtype=torch.float32, device=x.device)
    if initial_state is not None:
        h = initial_state.float().clone()
    for i in range(nc):
        y[i] += torch.exp(a[i])[:, :, None] * torch.einsum("lhn,hpn->lhp", c[i], h)
        h = torch.exp(a[i, -1])[:, None, None] * h + chunk_states[i]
    y = y.reshape(nc * q, num_heads, head_dim)[:length] + D.float()[None, :, None] * x.float()
    return y.to(x.dtype), h
