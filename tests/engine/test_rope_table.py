"""Rotary cos/sin from a per-position table (engine/models/rope.py): what the per-step
computation gives, bit for bit; built only where it fits and never inside a graph capture."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.models import rope
from splitserve.engine.models.rope import RotaryEmbedding

LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [None, LLAMA3])
def test_table_rows_are_the_computed_cos_and_sin(dtype, scaling):
    r = RotaryEmbedding(64, 500000.0, scaling, max_positions=70_000)  # more than one build chunk
    table = r._table(torch.device("cpu"), dtype)
    assert table.shape == (70_000, 128) and table.dtype == dtype
    positions = torch.cat((torch.tensor([0, 1, 32767, 32768, 69_999]), torch.randint(0, 70_000, (300,))))
    cos, sin = r._compute(positions, dtype)
    rows = table.index_select(0, positions)
    assert torch.equal(rows[:, :64], cos) and torch.equal(rows[:, 64:], sin)
    assert r._table(torch.device("cpu"), dtype) is table  # built once per device and dtype


def test_no_table_past_the_size_cap_or_without_a_length(monkeypatch):
    monkeypatch.setattr(rope, "TABLE_MAX_BYTES", 1000)
    assert RotaryEmbedding(64, 10000.0, None, max_positions=100)._table(torch.device("cpu"), torch.float16) is None
    monkeypatch.undo()
    assert RotaryEmbedding(64, 10000.0, None)._table(torch.device("cpu"), torch.float16) is None


def test_the_cpu_computes_them_per_step():
    r = RotaryEmbedding(16, 10000.0, None, max_positions=64)
    cos, sin = r.cos_sin(torch.arange(5, 9), torch.float32)
    assert cos.is_contiguous() and not r._tables


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the table is used on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_gpu_the_gathered_cos_sin_equal_the_computed(dtype):
    r = RotaryEmbedding(64, 500000.0, LLAMA3, max_positions=131_072).cuda()
    positions = torch.randint(0, 131_072, (257,), device="cuda")
    cos, sin = r.cos_sin(positions, dtype)
    want_cos, want_sin = r._compute(positions, dtype)
    assert r._tables and torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert cos.stride() == sin.stride() == (128, 1)  # one row stride, as the rotary kernels take them
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    fresh = RotaryEmbedding(64, 500000.0, None, max_positions=1024).cuda()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        fresh.cos_sin(positions % 1024, dtype)  # no table exists: computed, none built in the capture
    assert not fresh._tables
