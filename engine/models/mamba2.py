"""The Mamba2 mixer (NemotronH / SSD) over the engine's slot-indexed recurrent state.

    x [T, hidden] ─in_proj─▶ z [T, d_in] | xBC [T, conv_dim] | dt [T, H]
    xBC ─causal depthwise conv (+ conv state)─ SiLU ─▶ x [T, H, P] | B [T, G, N] | C [T, G, N]
    (x, dt, A, B, C, D) ─SSD scan (prefill) / recurrent step (decode), SSM state [H, P, N]─▶ y [T, d_in]
    y ─gated RMSNorm (y·silu(z), normalised per group of d_in / G channels)─ out_proj ─▶ [T, hidden]

Tensor parallel: rank r holds heads [r·H/tp, (r+1)·H/tp) and groups [r·G/tp, (r+1)·G/tp)
(so its heads read only its groups). in_proj rows, conv channels, dt_bias / A / D and
the norm weight are sliced to them; out_proj is split by input columns and all-reduced.
A rank's conv channels are therefore NOT one slice of the full conv_dim but three:

    full:   [ x: H·P                    | B: G·N          | C: G·N          ]
    rank r: [ x heads of r              | B groups of r   | C groups of r   ]

State (see `state_pool.py`), per local mamba layer:
    conv [num_slots, conv_dim_local, K - 1]   ssm [num_slots, H_local, P, N]
A sequence's state lives at its slot; prefill chunks read and update it, so chunked
prefill carries it across chunks, and `saves` copy it at block boundaries into the
prefix-state store (prefix caching of the recurrent state).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.attention import TRITON_KERNEL_BACKENDS
from splitserve.engine.models.config import ModelConfig
from splitserve.engine.parallel import ParallelState
from splitserve.kernels import ssm_reference as ref


@dataclass(frozen=True)
class MambaPrefill:
    """One sequence's prefill chunk: flat-batch tokens [q_start, q_start + q_len)."""

    q_start: int
    q_len: int
    slot: int
    saves: tuple[tuple[int, int], ...] = ()
    """(tokens of this chunk processed, prefix-state index): copy the state there then."""


@dataclass(frozen=True)
class MambaMetadata:
    decode_token_idx: torch.Tensor
    """[Bd] flat-batch index of each one-token (decode) sequence."""
    decode_slots: torch.Tensor
    """[Bd] their state slots."""
    prefills: tuple[MambaPrefill, ...] = ()
    backend: str = "torch"
    """`torch` (kernels/ssm_reference.py) or `triton` (kernels/ssm_state_update.py, ssd_scan.py)."""


@dataclass(frozen=True)
class MambaLayerState:
    """One local mamba layer's tensors (views into the state pool)."""

    conv: torch.Tensor
    ssm: torch.Tensor
    prefix_conv: torch.Tensor | None = None
    prefix_ssm: torch.Tensor | None = None


def mamba_shard(cfg: ModelConfig, tp_size: int, tp_rank: int) -> tuple[slice, slice]:
    """(heads, groups) of a TP rank."""
    heads, groups = cfg.mamba_num_heads, cfg.mamba_num_groups
    if heads % tp_size or groups % tp_size:
        raise ValueError(
            f"mamba heads {heads} / groups {groups} cannot be split over tensor_parallel_size {tp_size}"
        )
    h, g = heads // tp_size, groups // tp_size
    return slice(tp_rank * h, (tp_rank + 1) * h), slice(tp_rank * g, (tp_rank + 1) * g)


def conv_channel_index(cfg: ModelConfig, tp_size: int, tp_rank: int) -> torch.Tensor:
    """Global conv channels of a TP rank, in its local order: [x heads | B groups | C groups]."""
    hs, gs = mamba_shard(cfg, tp_size, tp_rank)
    p, n, d_in, gn = cfg.mamba_head_dim, cfg.ssm_state_size, cfg.mamba_d_inner, cfg.mamba_num_groups * cfg.ssm_state_size
    x = torch.arange(hs.start * p, hs.stop * p)
    b = torch.arange(d_in + gs.start * n, d_in + gs.stop * n)
    return torch.cat([x, b, b + gn])


def in_proj_row_index(cfg: ModelConfig, tp_size: int, tp_rank: int) -> torch.Tensor:
    """Rows of in_proj a TP rank keeps: [z heads | conv channels | dt heads]."""
    hs, _ = mamba_shard(cfg, tp_size, tp_rank)
    p, d_in = cfg.mamba_head_dim, cfg.mamba_d_inner
    z = torch.arange(hs.start * p, hs.stop * p)
    dt = torch.arange(d_in + cfg.mamba_conv_dim + hs.start, d_in + cfg.mamba_conv_dim + hs.stop)
    return torch.cat([z, d_in + conv_channel_index(cfg, tp_size, tp_rank), dt])


class _Conv(nn.Module):
    """Holds the depthwise conv's parameters under HF's names (`conv1d.weight` [C, 1, K], `conv1d.bias`)."""

    def __init__(self, channels: int, taps: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, taps))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None


class GatedRMSNorm(nn.Module):
    """y·silu(z), normalised over each group of `group_size` channels (fp32), times weight."""

    def __init__(self, size: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        h = y.float() * F.silu(z.float())
        g = h.view(*h.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(h.shape).to(dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState):
        super().__init__()
        hs, gs = mamba_shard(cfg, ps.tp_size, ps.tp_rank)
        self.ps = ps
        self.num_heads = hs.stop - hs.start
        self.num_groups = gs.stop - gs.start
        self.head_dim = cfg.mamba_head_dim
        self.state_size = cfg.ssm_state_size
        self.d_inner = self.num_heads * self.head_dim
        self.conv_dim = self.d_inner + 2 * self.num_groups * self.state_size
        self.chunk_size = cfg.mamba_chunk_size
        self.dt_min = cfg.time_step_min
        self.in_proj = nn.Linear(cfg.hidden_size, self.d_inner + self.conv_dim + self.num_heads, bias=cfg.mamba_proj_bias)
        self.conv1d = _Conv(self.conv_dim, cfg.conv_kernel, cfg.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.D = nn.Parameter(torch.empty(self.num_heads))
        self.norm = GatedRMSNorm(self.d_inner, cfg.mamba_d_inner // cfg.mamba_num_groups, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.d_inner, cfg.hidden_size, bias=cfg.mamba_proj_bias)

    def _split_xbc(self, xbc: torch.Tensor):
        """[T, conv_dim] -> x [T, H, P], B [T, G, N], C [T, G, N]."""
        gn = self.num_groups * self.state_size
        xs, b, c = xbc.split([self.d_inner, gn, gn], dim=-1)
        t = xbc.shape[0]
        return (
            xs.reshape(t, self.num_heads, self.head_dim),
            b.reshape(t, self.num_groups, self.state_size),
            c.reshape(t, self.num_groups, self.state_size),
        )

    def forward(self, x: torch.Tensor, state: MambaLayerState, meta: MambaMetadata) -> torch.Tensor:
        t = x.shape[0]
        z, xbc, dt = self.in_proj(x).split([self.d_inner, self.conv_dim, self.num_heads], dim=-1)
        A = -torch.exp(self.A_log.float())
        weight = self.conv1d.weight[:, 0, :]
        y = torch.empty(t, self.num_heads, self.head_dim, dtype=x.dtype, device=x.device)
        if meta.decode_token_idx.numel():
            idx, slots = meta.decode_token_idx, meta.decode_slots
            conv_out = _op(meta.backend, "causal_conv1d_update")(xbc[idx], state.conv, weight, self.conv1d.bias, slots)
            xs, b, c = self._split_xbc(conv_out)
            y[idx] = _op(meta.backend, "selective_state_update")(
                state.ssm, xs, dt[idx], A, b, c, self.D, self.dt_bias, slots, self.dt_min
            )
        for seq in meta.prefills:
            y[seq.q_start : seq.q_start + seq.q_len] = self._prefill(xbc, dt, A, weight, state, seq, meta.backend)
        out = self.norm(y.reshape(t, self.d_inner), z)
        return self.ps.all_reduce_tp(self.out_proj(out))

    def _prefill(self, xbc, dt, A, weight, state: MambaLayerState, seq: MambaPrefill, backend: str) -> torch.Tensor:
        """Scan one chunk in segments that end at its save points; returns y [q_len, H, P]."""
        conv_state, ssm_state = state.conv[seq.slot], state.ssm[seq.slot].float()
        saves = dict(seq.saves)
        cuts = sorted({0, seq.q_len, *(k for k in saves if 0 < k < seq.q_len)})
        scan, conv = _op(backend, "ssd_chunk_scan"), _op(backend, "causal_conv1d")
        outs = []
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            sl = slice(seq.q_start + lo, seq.q_start + hi)
            conv_out, conv_state = conv(xbc[sl], weight, self.conv1d.bias, conv_state)
            xs, b, c = self._split_xbc(conv_out)
            out, ssm_state = scan(xs, dt[sl], A, b, c, self.D, self.dt_bias, self.chunk_size, ssm_state, self.dt_min)
            outs.append(out)
            if hi in saves and state.prefix_conv is not None:
                state.prefix_conv[saves[hi]] = conv_state
                state.prefix_ssm[saves[hi]] = ssm_state.to(state.prefix_ssm.dtype)
        state.conv[seq.slot] = conv_state
        state.ssm[seq.slot] = ssm_state.to(state.ssm.dtype)
        return torch.cat(outs)


def _op(backend: str, name: str):
    """Op `name` (a kernel of `splitserve.kernels`, whose torch reference is `name` + "_reference" in
    kernels/ssm_reference.py): the Triton kernel on the Triton backends, else the reference."""
    if backend in TRITON_KERNEL_BACKENDS:
        from splitserve import kernels

        return getattr(kernels, name)
    return getattr(ref, f"{name}_reference")
