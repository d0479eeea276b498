"""The FlashInfer attention backend (engine/attention_flashinfer.py): its page-table form and its
clear refusal where it cannot run (any machine); on a GPU with the flashinfer package, its
attention against the fp32 reference and the engine's greedy tokens against the Triton backend's,
eager and from CUDA graphs."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from splitserve.engine.attention_flashinfer import paged_indices
from splitserve.engine.config import EngineConfig

needs_flashinfer = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
    reason="FlashInfer needs a GPU and the flashinfer package",
)


def test_paged_indices_cut_each_padded_table_to_its_context():
    tables = np.array([[7, 3, 9, 99], [4, 99, 99, 99], [1, 2, 5, 6]])
    indptr, indices, last = paged_indices(tables, [33, 1, 64], 16)
    assert indptr.tolist() == [0, 3, 4, 8]
    assert indices.tolist() == [7, 3, 9, 4, 1, 2, 5, 6]
    assert last.tolist() == [1, 1, 16]
    assert {indptr.dtype, indices.dtype, last.dtype} == {torch.int32}


def test_unknown_backend_and_flashinfer_without_cuda_are_refused_clearly(tmp_path):
    with pytest.raises(ValueError, match="flashinfer"):  # the message lists the choices
        EngineConfig(model="m", attention_backend="flashinfr")
    from splitserve import LLM
    from tests.fixtures.models import build_hf_checkpoint

    build_hf_checkpoint(tmp_path, "llama", num_hidden_layers=1)
    with pytest.raises(ValueError, match="flashinfer needs a CUDA device"):
        LLM(str(tmp_path), device="cpu", attention_backend="flashinfer", num_blocks=16)


@needs_flashinfer
@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "mixed"])
def test_flashinfer_attention_matches_the_reference(decode_only):
    from splitserve.engine.attention_flashinfer import FlashInferPlanner, Shape
    from splitserve.kernels import reference

    hq, hkv, d, bs = 8, 2, 64, 16
    g = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(2, 64, hkv, bs, d, device="cuda", dtype=torch.bfloat16, generator=g)
    ctx_lens = [1, 17, 100, 300] if decode_only else [40, 9, 33, 200]
    q_lens = [1] * 4 if decode_only else [7, 1, 33, 16]  # chunks over a cached prefix, a decode row, a whole prompt
    ids = torch.randperm(63, generator=torch.Generator().manual_seed(1)).tolist()
    tables, used = [], 0
    for n in ctx_lens:
        pages = -(-n // bs)
        tables.append(ids[used : used + pages] + [63] * (20 - pages))
        used += pages
    q_starts = np.concatenate([[0], np.cumsum(q_lens)]).tolist()
    q = torch.randn(q_starts[-1], hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    scale = d**-0.5
    planner = FlashInferPlanner(torch.device("cuda"), Shape(hq, hkv, d, bs, torch.bfloat16, scale))
    got = planner.plan(tables, ctx_lens, q_starts, decode_only).run(q, kv)
    table_t = torch.tensor(tables, device="cuda")
    lens_t = torch.tensor(ctx_lens, device="cuda")
    if decode_only:
        expected = reference.paged_decode_reference(q.float(), kv.float(), table_t, lens_t, scale)
    else:
        starts_t = torch.tensor(q_starts, device="cuda")
        expected = reference.paged_prefill_reference(q.float(), kv.float(), table_t, starts_t, lens_t, scale)
    assert (got.float() - expected).abs().max().item() < 2e-2


@needs_flashinfer
def test_engine_on_flashinfer_gives_the_triton_backends_tokens(tmp_path):
    """bf16, chunked prompts (mixed prefill + decode steps through FlashInfer's prefill wrapper),
    decode eager and replayed from graphs (FlashInfer's decode wrapper planned per replay)."""
    from splitserve import LLM, SamplingParams
    from tests.fixtures.models import build_hf_checkpoint

    build_hf_checkpoint(tmp_path, "llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 40, 130, 300)]
    params = SamplingParams(num_tokens_to_generate=24, temperature=0.0, ignore_eos=True, return_log_probs=True)
    options = dict(device="cuda", dtype="bfloat16", block_size_tokens=16, num_blocks=256, max_tokens=64)
    runs = {}
    for backend, graphs in (("triton", True), ("flashinfer", False), ("flashinfer", True)):
        llm = LLM(str(tmp_path), attention_backend=backend, enable_cuda_graphs=graphs, **options)
        assert (llm.engine.runner.graphs is not None) == graphs
        runs[backend, graphs] = [(r.generated_tokens, r.generated_log_probs) for r in llm.generate(prompts, params)]
        llm.engine.check_integrity()
        if graphs:
            assert llm.engine.runner.graphs._static, "no decode step replayed a graph"
    # bf16 rounding differs between the kernels, so a near-tie can flip a token (the torch backend flips
    # earlier still: measured on the H200): tokens must agree, with log-probs within 0.05, up to a
    # position where both backends' picks were a near-tie (their log-probs within 0.02)
    ref = runs["triton", True]
    for key in (("flashinfer", False), ("flashinfer", True)):
        for (tokens, log_probs), (ref_tokens, ref_log_probs) in zip(runs[key], ref, strict=True):
            agreed = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)) if a != b), len(tokens))
            gaps = [abs(a - b) for a, b in zip(log_probs[:agreed], ref_log_probs[:agreed], strict=True)]
            assert max(gaps, default=0.0) < 0.05, (key, gaps)
            if agreed < len(tokens):
                assert abs(log_probs[agreed] - ref_log_probs[agreed]) < 0.02, (key, agreed, tokens)
