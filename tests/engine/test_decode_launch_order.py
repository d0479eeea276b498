"""Which decode steps let the attention's programs launch while the qkv kernel still runs (PDL):
the rule of engine/models/fused.py, measured per batch regime on an H100 (benchmarks/RESULTS.md,
2026-12-06 session 33). The launches themselves are checked by the GPU kernel tests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from splitserve import kernels  # noqa: E402
from splitserve.engine.models import fused  # noqa: E402

KV = torch.empty(2, 4, 8, 16, 8)  # [2, blocks, kv heads, block size, head dim]


def _meta(planned=None, decode_only=True, width=128):
    return SimpleNamespace(planned=planned, is_decode_only=decode_only, block_tables=torch.zeros(1, width))


@pytest.mark.parametrize("rows", [1, 8, 16])
def test_small_batches_launch_the_attention_at_the_qkv_kernels_exit(rows):
    assert not fused._attention_launched_early(rows, KV, _meta())


def test_larger_batches_launch_a_split_attention_early_and_an_unsplit_one_at_exit(monkeypatch):
    seen = []

    def unsplit(batch, kv, max_blocks):
        seen.append((batch, max_blocks))
        return batch >= 48

    monkeypatch.setattr(kernels, "decode_attention_unsplit", unsplit, raising=False)
    assert fused._attention_launched_early(32, KV, _meta())
    assert not fused._attention_launched_early(64, KV, _meta())
    assert seen == [(32, 128), (64, 128)]  # asked with the step's rows and block-table width


def test_flashinfer_and_prefill_steps_keep_the_early_signal():
    assert fused._attention_launched_early(8, KV, _meta(planned=object()))
    assert fused._attention_launched_early(8, KV, _meta(decode_only=False))
