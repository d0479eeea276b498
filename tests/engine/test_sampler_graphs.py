"""Sampler draws replayed from CUDA graphs (engine/sampler_graphs.py): step after step, with
changing logits, parameters, seeds and rows, they give `kernels.sample_rows`' eager tokens;
draws the graphs cannot take are left to the eager sampler (None)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from splitserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _chunks(params: list[SamplingParams]) -> list:
    return [SimpleNamespace(request=SimpleNamespace(params=p, seed=1000 + 7 * i)) for i, p in enumerate(params)]


def _eager(logits, chunks, picked):
    from splitserve import kernels

    ps = [chunks[i].request.params for i in picked]
    vocab = logits.shape[1]
    t = torch.tensor([p.temperature for p in ps], device=logits.device)
    k = torch.tensor([p.top_k for p in ps], device=logits.device)
    p_ = torch.tensor([p.top_p for p in ps], device=logits.device)
    seeds = torch.tensor([chunks[i].request.seed for i in picked], device=logits.device)
    rows = torch.tensor(picked, device=logits.device)
    max_k = max((p.top_k for p in ps if 0 < p.top_k < vocab), default=0)
    return kernels.sample_rows(logits, t, k, p_, seeds, rows=rows, max_top_k=max_k,
                               any_top_p=any(0 < p.top_p < 1 for p in ps), top_p_within_top_k=True)


def test_graphed_draws_equal_eager_draws_step_after_step():
    from splitserve.engine.sampler_graphs import SamplerGraphs

    g = torch.Generator().manual_seed(3)
    buffer = torch.empty(8, 5000, device="cuda")
    graphs = SamplerGraphs(buffer)
    steps = [
        ([SamplingParams(temperature=0.8, top_k=40, top_p=0.9)] * 8, list(range(8))),
        ([SamplingParams(temperature=1.2)] * 5, [0, 2, 4]),
        ([SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
          SamplingParams(temperature=0.9, top_k=300, top_p=0.5)], [0, 2, 3]),
        ([SamplingParams(temperature=0.8, top_k=40, top_p=0.9)] * 8, [7, 1, 5]),
    ]
    for step, (params, picked) in enumerate(steps * 2):
        buffer.copy_(torch.randn(8, 5000, generator=g))
        chunks = _chunks(params)
        for c in chunks:
            c.request.seed += step
        got = graphs.draw(chunks, picked, lambda req: req.seed)
        assert got is not None
        assert torch.equal(got, _eager(buffer, chunks, picked)), step
    assert len(graphs._draws) == 4  # one graph per (rows, top-k bucket, top-p), replayed on the second pass


def test_draws_the_graphs_cannot_take_are_left_to_the_eager_sampler():
    from splitserve.engine.sampler_graphs import MAX_TOP_K, SamplerGraphs

    graphs = SamplerGraphs(torch.zeros(4, 3000, device="cuda"))
    top_p_alone = _chunks([SamplingParams(temperature=1.0, top_p=0.8)])
    assert graphs.draw(top_p_alone, [0], lambda req: req.seed) is None  # needs a full sort
    huge_k = _chunks([SamplingParams(temperature=1.0, top_k=MAX_TOP_K + 1)])
    assert graphs.draw(huge_k, [0], lambda req: req.seed) is None
    assert not graphs._draws
