"""CUDA graphs for steps with prefill chunks (engine/mixed_graphs.py): the token buckets and the
graph inputs against the eager step's (any machine); on a GPU, aggregated serving with chunked
prefill replays them and gives the eager engine's tokens and log-probs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from splitserve.engine.batch import prepare_inputs
from splitserve.engine.mixed_graphs import fill, split, token_buckets
from splitserve.engine.scheduler import ScheduledChunk, SchedulerOutput


def test_token_buckets_double_from_16_up_to_the_budget():
    assert token_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(8) == [8]


def test_the_token_budget_fits_the_padding_sequence_in_the_narrowest_block_table():
    from splitserve.engine.cuda_graphs import DecodeGraphs
    from splitserve.engine.mixed_graphs import MixedGraphs

    def mixed(max_blocks: int) -> MixedGraphs:
        decode = DecodeGraphs(None, [], max_batch=8, max_blocks=max_blocks, scratch_block=9, block_size=16)
        return MixedGraphs(decode, 512)

    assert mixed(4096).token_buckets == [16, 32, 64, 128, 256, 512]  # the 2k-token bucket holds 512
    assert mixed(4).token_buckets == [16, 32, 64]  # a 64-token model: 4 blocks hold 64 padding tokens


@dataclass
class _Req:
    tokens: list[int]
    block_ids: list[int]

    def token_slice(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


def test_filled_inputs_are_the_eager_steps_plus_padding_over_the_scratch_block():
    bs, scratch = 4, 99
    a = _Req(list(range(100, 111)), [7, 3, 12])  # decode of its 11th token
    b = _Req(list(range(200, 230)), [5, 9, 1, 2, 8, 6, 4, 0])  # a chunk over a cached prefix
    c = _Req(list(range(300, 305)), [10, 11])  # a whole short prompt
    chunks = (ScheduledChunk(a, 10, 1, True), ScheduledChunk(b, 8, 13, False), ScheduledChunk(c, 0, 5, True))
    eager = prepare_inputs(SchedulerOutput(chunks, ()), bs, scratch, "triton", torch.device("cpu"))
    tokens, seqs, width = 32, 4, 8
    buf = np.full(3 * tokens + 2 * seqs + 1 + seqs * width, -5, dtype=np.int64)
    ids, positions, slots, q_starts, ctx_lens, tables = split(buf, tokens, seqs, width)
    fill((ids, positions, slots, q_starts, ctx_lens, tables), chunks, bs, scratch)
    n = 19
    assert ids[:n].tolist() == eager.input_ids.tolist()
    assert positions[:n].tolist() == eager.positions.tolist()
    assert slots[:n].tolist() == eager.meta.slot_mapping.tolist()
    assert q_starts[:4].tolist() == eager.meta.q_starts.tolist()
    assert ctx_lens[:3].tolist() == eager.meta.ctx_lens.tolist()
    w = eager.meta.block_tables.shape[1]
    assert tables[:3, :w].tolist() == eager.meta.block_tables.tolist()
    assert (tables[:3, w:] == scratch).all() and (tables[3:] == scratch).all()
    # padding: one sequence of the 13 tokens left, all on the scratch block; nothing else touched
    assert q_starts[3:].tolist() == [19, 32] and ctx_lens[3] == 13
    assert ((slots[n:] // bs) == scratch).all() and (positions[n:] < bs).all()
    assert (buf != -5).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_chunked_prefill_beside_decodes_replays_mixed_graphs_with_the_eager_tokens(tmp_path):
    from splitserve import LLM, SamplingParams
    from tests.fixtures.models import build_hf_checkpoint

    build_hf_checkpoint(tmp_path, "llama")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (3, 50, 130, 17, 300, 64)]
    params = SamplingParams(
        num_tokens_to_generate=12, temperature=0.0, ignore_eos=True, return_log_probs=True, skip_prompt_log_probs=False
    )
    options = dict(device="cuda", dtype="float32", block_size_tokens=16, num_blocks=256, max_tokens=64)
    runs = {}
    for mixed in (0, 64):
        llm = LLM(str(tmp_path), cuda_graph_mixed_max_tokens=mixed, **options)
        runs[mixed] = llm.generate(prompts, params)
        llm.engine.check_integrity()
        graphs = llm.engine.runner.graphs.mixed
        assert (graphs is None) == (mixed == 0)
        if mixed:
            assert len(graphs._static) >= 2, "steps with prefill chunks did not replay mixed graphs"
    for eager, graphed in zip(runs[0], runs[64], strict=True):
        assert graphed.generated_tokens == eager.generated_tokens
        lp = np.array(graphed.generated_log_probs + graphed.prompt_log_probs)
        lp_eager = np.array(eager.generated_log_probs + eager.prompt_log_probs)
        assert np.abs(lp - lp_eager).max() < 1e-4
