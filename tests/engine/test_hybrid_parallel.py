"""Hybrid (NemotronH) TP and PP engines (one process per rank, gloo) produce the single
rank's tokens: mamba heads and B/C groups split over TP ranks (in_proj and conv rows
gathered per rank), the layer pattern split over PP stages; chunked prefill and prefix
caching on, so the recurrent state crosses chunks and is restored from the prefix store."""

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.launch import generate_on_ranks
from splitserve.engine.models.config import ModelConfig
from splitserve.engine.models.mamba2 import conv_channel_index, in_proj_row_index
from tests.fixtures.models import build_hybrid_checkpoint

OPTIONS = dict(block_size_tokens=8, num_blocks=128, max_tokens=24)
PARAMS = SamplingParams(num_tokens_to_generate=32, temperature=0.0, ignore_eos=True, return_log_probs=True,
                        skip_prompt_log_probs=True)


def _prompts():
    g = torch.Generator().manual_seed(3)
    first = torch.randint(3, 512, (40,), generator=g).tolist()
    return [torch.randint(3, 512, (5,), generator=g).tolist(), first, first[:24] + [7, 8, 9]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid_par")
    build_hybrid_checkpoint(path)
    return str(path), LLM(str(path), **OPTIONS).generate(_prompts(), PARAMS)


def _check(reference, tp, pp):
    path, expected = reference
    results = generate_on_ranks(path, _prompts(), PARAMS, tp, pp, **OPTIONS)
    for ours, ref in zip(results, expected, strict=True):
        assert ours.generated_tokens == ref.generated_tokens
        assert max(abs(a - b) for a, b in zip(ours.generated_log_probs, ref.generated_log_probs, strict=True)) < 1e-4
    assert [r.num_cached_tokens for r in results] == [r.num_cached_tokens for r in expected]


def test_tensor_parallel_2(reference):
    _check(reference, tp=2, pp=1)


@pytest.mark.slow
def test_pipeline_parallel_2_and_tp2_pp2(reference):
    _check(reference, tp=1, pp=2)
    _check(reference, tp=2, pp=2)


def test_tp_rows_of_in_proj_and_conv(reference):
    cfg = ModelConfig.from_checkpoint(reference[0])  # 8 heads x 8, 2 groups x 16: conv_dim 64 + 64
    rows = conv_channel_index(cfg, 2, 1).tolist()
    assert rows == list(range(32, 64)) + list(range(64 + 16, 64 + 32)) + list(range(96 + 16, 96 + 32))
    proj = in_proj_row_index(cfg, 2, 1).tolist()
    assert proj[:32] == list(range(32, 64))  # z of heads 4-7
    assert proj[32:96] == [64 + r for r in rows]  # then the conv channels
    assert proj[96:] == list(range(64 + 128 + 4, 64 + 128 + 8))  # dt of heads 4-7
