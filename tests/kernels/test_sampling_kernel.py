"""Batched device sampling (kernels/sampling.py): masks equal the per-row host sampler's,
draws are reproducible per seed, never pick a masked token, and follow the softmax."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from splitserve.engine.sampler import process_logits  # noqa: E402
from splitserve.engine.sampling_params import SamplingParams  # noqa: E402
from splitserve.kernels.sampling import mask_logits, sample_rows  # noqa: E402


def _params(n, t=1.0, k=0, p=0.0, device="cpu"):
    return (torch.full((n,), t, device=device), torch.full((n,), k, device=device),
            torch.full((n,), p, device=device))


def test_masks_equal_the_host_sampler_row_by_row(device):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=g).to(device)
    settings = [(0.7, 0, 0.0), (1.3, 5, 0.0), (0.9, 0, 0.8), (1.0, 40, 0.5)]
    t = torch.tensor([s[0] for s in settings], device=device)
    k = torch.tensor([s[1] for s in settings], device=device)
    p = torch.tensor([s[2] for s in settings], device=device)
    got = mask_logits(logits, t, k, p)
    for row, (temp, top_k, top_p) in enumerate(settings):
        want = process_logits(logits[row], SamplingParams(temperature=temp, top_k=top_k, top_p=top_p))
        assert torch.equal(torch.isinf(got[row]), torch.isinf(want))
        torch.testing.assert_close(got[row][~torch.isinf(want)], want[~torch.isinf(want)])


def test_draws_are_seeded_and_respect_top_k(device):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 5000, generator=g).to(device)
    seeds = torch.arange(100, 106, device=device)
    t, k, p = _params(6, t=1.0, k=3, device=device)
    a = sample_rows(logits, t, k, p, seeds)
    assert torch.equal(a, sample_rows(logits, t, k, p, seeds))  # same seeds, same tokens
    top3 = logits.topk(3, dim=-1).indices
    assert all(int(a[i]) in top3[i].tolist() for i in range(6))
    many = torch.stack([sample_rows(logits, t, k, p, seeds + 1000 * s) for s in range(8)])
    assert len(set(many[:, 0].tolist())) > 1  # different seeds, different draws


def test_draws_follow_the_softmax(device):
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]], device=device).repeat(2000, 1)
    t, k, p = _params(2000, device=device)
    tokens = sample_rows(logits, t, k, p, torch.arange(2000, device=device)).cpu()
    freq = torch.bincount(tokens, minlength=4).float() / 2000
    want = torch.softmax(logits[0].cpu(), -1)
    assert (freq - want).abs().max() < 0.04, (freq, want)


def test_top_p_over_top_k_values_equals_full_sort(device):
    """Every top-p row has a top-k: the cheap path (top-p on the topk values) masks the same."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 400, generator=g).to(device)
    t = torch.tensor([0.8, 1.0, 1.2], device=device)
    k = torch.tensor([30, 7, 100], device=device)
    p = torch.tensor([0.6, 0.0, 0.9], device=device)
    got = mask_logits(logits, t, k, p, max_top_k=100, any_top_p=True)
    for row in range(3):
        params = SamplingParams(temperature=float(t[row]), top_k=int(k[row]), top_p=float(p[row]))
        assert torch.equal(torch.isinf(got[row]), torch.isinf(process_logits(logits[row], params)))


def test_rejects_bad_shapes(device):
    t, k, p = _params(2, device=device)
    with pytest.raises(ValueError, match="expected"):
        sample_rows(torch.zeros(1, 8, device=device), t, k, p, torch.zeros(1, dtype=torch.long, device=device))


def test_threshold_path_draws_what_the_masked_path_draws(device):
    """With the flags given (and every top-p row also top-k), the draw masks by per-row
    thresholds as it reads the logits; it must draw exactly what the masked-logits path draws,
    also for a subset of rows picked by `rows`."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 3000, generator=g).to(device)
    t = torch.tensor([0.7, 1.0, 1.3, 0.9, 1.1, 0.5], device=device)
    k = torch.tensor([0, 5, 40, 0, 100, 1], device=device)
    p = torch.tensor([0.0, 0.0, 0.8, 0.0, 0.95, 0.0], device=device)
    seeds = torch.arange(6, device=device) * 31
    for s in range(4):
        fast = sample_rows(logits, t, k, p, seeds + s, max_top_k=100, any_top_p=True, top_p_within_top_k=True)
        masked = sample_rows(logits, t, k, p, seeds + s)  # flags read back: masks first
        assert torch.equal(fast, masked), (s, fast, masked)
        assert int(fast[5]) == int(logits[5].argmax())  # top-k 1
    rows = torch.tensor([4, 1, 2], device=device)
    got = sample_rows(logits, t[rows], k[rows], p[rows], seeds[rows], max_top_k=100, any_top_p=True,
                      top_p_within_top_k=True, rows=rows)
    assert torch.equal(got, sample_rows(logits, t, k, p, seeds)[rows])
    plain = torch.zeros(6, dtype=torch.long, device=device)  # temperature only: no topk, no thresholds
    got = sample_rows(logits, t, plain, plain.float(), seeds, max_top_k=0, any_top_p=False, top_p_within_top_k=True)
    assert torch.equal(got, sample_rows(logits, t, plain, plain.float(), seeds))
    assert len(set(got.tolist())) > 1


def test_parameter_columns_of_one_table_draw_as_separate_tensors(device):
    """The engine passes columns of one [N, 3] table (strided views): each row must get its
    own seed, top-k and logits row, as with separate contiguous tensors."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(5, 2000, generator=g).to(device)
    table = torch.tensor([[4, 3, 101], [0, 0, 202], [2, 8, 303], [1, 0, 404]], device=device)
    temps = torch.tensor([0.9, 1.0, 1.1, 0.8], device=device)
    flags = dict(max_top_k=8, any_top_p=False, top_p_within_top_k=True)
    zeros = torch.zeros(4, device=device)
    got = sample_rows(logits, temps, table[:, 1], zeros, table[:, 2], rows=table[:, 0], **flags)
    want = sample_rows(logits[table[:, 0].clone()], temps, table[:, 1].clone(), zeros, table[:, 2].clone(), **flags)
    assert torch.equal(got, want)
    for row, seed in enumerate(table[:, 2].tolist()):  # each row drawn alone with its own seed
        alone = sample_rows(logits[table[row, 0]][None], temps[row:row + 1], table[row:row + 1, 1].clone(),
                            zeros[:1], torch.tensor([seed], device=device), **flags)
        assert int(alone[0]) == int(got[row])


def test_rows_masked_to_a_few_tokens_draw_only_those(device):
    """Guided rows reach the sampler with every token their grammar refuses at -inf
    (engine/step_sampling.py `_guided_batch`): whatever the temperature, top-k (also past the
    allowed count) or top-p, and on both paths (flags given or read back), only allowed tokens
    are drawn — a single allowed token always."""
    g = torch.Generator().manual_seed(11)
    vocab = 3000
    logits = torch.randn(6, vocab, generator=g)
    allowed = [torch.randperm(vocab, generator=g)[:n] for n in (1, 2, 3, 10, 50, 1)]
    for row, ids in enumerate(allowed):
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[ids] = True
        logits[row].masked_fill_(~keep, float("-inf"))
    logits = logits.to(device)
    t = torch.tensor([1.0, 0.7, 1.5, 1.0, 0.9, 2.0], device=device)
    k = torch.tensor([0, 5, 0, 40, 100, 20], device=device)
    p = torch.tensor([0.0, 0.0, 0.9, 0.5, 0.95, 0.0], device=device)
    within = torch.where(k > 0, p, torch.zeros_like(p))  # every top-p row also top-k: the threshold path
    for s in range(6):
        seeds = torch.arange(6, device=device) * 17 + 1000 * s
        for top_p, flags in ((p, {}), (p, dict(max_top_k=100, any_top_p=True, top_p_within_top_k=False)),
                             (within, dict(max_top_k=100, any_top_p=True, top_p_within_top_k=True))):
            got = sample_rows(logits, t, k, top_p, seeds, **flags).tolist()
            assert all(tok in ids.tolist() for tok, ids in zip(got, allowed, strict=True)), (s, flags, got)
            assert got[0] == int(allowed[0][0]) and got[5] == int(allowed[5][0])
