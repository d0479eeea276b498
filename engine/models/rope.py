"""Rotary position embeddings: default, linear and llama3 frequency scaling.

The inverse frequencies are computed exactly as Hugging Face does, so fp32
logits match to rounding.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


TABLE_MAX_BYTES = 128 << 20
"""Largest cos/sin table a RotaryEmbedding keeps per device and dtype (Llama-3.2-1B: 131,072
positions x 2 x 64 bf16 = 33.5 MB); longer contexts compute cos/sin per step."""


class RotaryEmbedding(torch.nn.Module):
    """cos / sin of the rotary angles. On CUDA they are gathered from a table of every position
    up to `max_positions`, built once per dtype outside any CUDA-graph capture (the warm-up's
    eager steps build it before the decode graphs are captured): one gather kernel a step where
    computing them took ~7 elementwise kernels (a cast, a product, a cat, cos, sin and two casts:
    ~8 µs of a batch-64 decode step on an H100, outside programmatic dependent launch,
    benchmarks/RESULTS.md session 31). The table holds what the per-step computation gives,
    bit for bit: the same ops on the same device, element by element. The CPU keeps computing
    them (vectorized and scalar cos may differ in the last bit there)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int = 0):
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, theta, scaling), persistent=False)
        self.max_positions = max_positions
        self._tables: dict[tuple, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, head_dim] (on CUDA: views of one gathered [T, 2 * head_dim])."""
        table = self._table(positions.device, dtype) if positions.is_cuda else None
        if table is None:
            return self._compute(positions, dtype)
        both = table.index_select(0, positions)
        half = both.shape[1] // 2
        return both[:, :half], both[:, half:]

    def tables(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(cos, sin) of every position, [P, head_dim] views of the table with one row stride,
        where a table is kept (CUDA), else None: for kernels that gather a step's rows themselves
        (`kernels.decode_qkv_rotary(..., positions=)`)."""
        table = self._table(device, dtype) if device.type == "cuda" else None
        if table is None:
            return None
        half = table.shape[1] // 2
        return table[:, :half], table[:, half:]

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _table(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        key = (device, dtype)
        table = self._tables.get(key)
        if table is not None or self.max_positions <= 0:
            return table
        width = 4 * self.inv_freq.numel()  # cos and sin rows, each head_dim = 2 x the frequencies
        if self.max_positions * width * dtype.itemsize > TABLE_MAX_BYTES or (
            device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        ):
            return None  # (captured without one: the graph computes them, as before)
        table = torch.empty(self.max_positions, width, dtype=dtype, device=device)
        chunk = 1 << 15  # positions per build step: bounded fp32 temporaries
        for start in range(0, self.max_positions, chunk):
            stop = min(start + chunk, self.max_positions)
            cos, sin = self._compute(torch.arange(start, stop, device=device), dtype)
            table[start:stop] = torch.cat((cos, sin), dim=-1)
        self._tables[key] = table
        return table


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class StepRotary:
    """A step's rotary inputs for the fused layers (engine/models/fused.py): the tables and the
    positions, for a qkv kernel that gathers its rows itself, and (`cos_sin`) the rows for
    every other consumer, gathered or computed once on first use."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype):
        self.rotary, self.positions, self.dtype = rotary, positions, dtype
        self.tables = rotary.tables(positions.device, dtype)
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rows is None:
            self._rows = self.rotary.cos_sin(self.positions, self.dtype)
        return self._rows
