"""Decode CUDA graphs per context bucket (engine/cuda_graphs.py): the buckets' widths, and on a
GPU, a prompt past the first bucket still decodes from a graph and gives the eager engine's tokens."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.cuda_graphs import FIRST_CONTEXT_BUCKET, context_buckets


def test_context_buckets_grow_by_four_up_to_the_largest():
    first = FIRST_CONTEXT_BUCKET // 16
    assert context_buckets(first * 16, 16) == [first, first * 4, first * 16]
    assert context_buckets(first * 5, 16) == [first, first * 4, first * 5]
    assert context_buckets(first, 16) == [first]
    assert context_buckets(100, 16) == [100]  # a model shorter than the first bucket


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_long_prompt_decodes_from_a_graph_with_the_eager_tokens(tmp_path):
    from splitserve import LLM, SamplingParams
    from tests.fixtures.models import build_hf_checkpoint

    build_hf_checkpoint(tmp_path, "llama", max_position_embeddings=4 * FIRST_CONTEXT_BUCKET)
    options = dict(device="cuda", block_size_tokens=16, num_blocks=1200, max_tokens=FIRST_CONTEXT_BUCKET + 512)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (20, FIRST_CONTEXT_BUCKET + 100)]
    params = SamplingParams(num_tokens_to_generate=8, temperature=0.0, ignore_eos=True)
    graphed = LLM(str(tmp_path), enable_cuda_graphs=True, **options)
    eager = LLM(str(tmp_path), enable_cuda_graphs=False, **options)
    for prompt in prompts:  # one at a time: the long one alone in its batch
        got = graphed.generate([prompt], params)[0].generated_tokens
        assert got == eager.generate([prompt], params)[0].generated_tokens
    widths = {width for _, width in graphed.engine.runner.graphs._static}
    assert min(widths) == FIRST_CONTEXT_BUCKET // 16 and max(widths) > FIRST_CONTEXT_BUCKET // 16, widths
