"""The step log-prob kernel (kernels/logprobs.py) against float64 torch: the chosen token's
log-prob, and the top N entries (ties: the lowest token id first) — over a vocabulary of three
parts, picked rows out of order, N = 0, 1, 5 (a rounded-up candidate count) and 20."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from splitserve.kernels.logprobs import row_logprobs  # noqa: E402

VOCAB = 17000  # three parts of the vocabulary (8192 each, the last one short)


def reference(logits, rows, tokens, top):
    """float64: log_softmax, the chosen entries, and the top `top` by (value desc, id asc)."""
    lp = torch.log_softmax(logits.double()[rows], dim=-1)
    chosen = lp.gather(1, tokens[:, None]).squeeze(1)
    order = [sorted(range(VOCAB), key=lambda j, v=row.tolist(): (-v[j], j))[:top] for row in lp]
    ids = torch.tensor(order, dtype=torch.long).view(len(rows), top)
    return chosen, lp.gather(1, ids), ids


@pytest.mark.parametrize("top", [0, 1, 5, 20])
def test_the_kernel_equals_float64_torch_with_ties_to_the_lowest_id(device, top):
    g = torch.Generator().manual_seed(top)
    logits = torch.randn(6, VOCAB, generator=g) * 3
    logits[4, [100, 9000, 16999]] = 40.0  # a three-way tie for the maximum across all three parts
    logits[4, [8191, 8192]] = 39.0  # and a tie for third place at a part boundary
    logits[1, :] = 0.0  # a flat row: every id ties
    rows = torch.tensor([4, 1, 0, 5], dtype=torch.long)
    tokens = torch.tensor([9000, 3, int(logits[0].argmax()), 16998], dtype=torch.long)
    chosen, values, ids = row_logprobs(logits.to(device), rows.to(device), tokens.to(device), top)
    want_chosen, want_values, want_ids = reference(logits, rows, tokens, top)
    torch.testing.assert_close(chosen.cpu().double(), want_chosen, atol=1e-5, rtol=0)
    if top == 0:
        assert values is None and ids is None
        return
    assert ids.cpu().tolist() == want_ids.tolist()
    torch.testing.assert_close(values.cpu().double(), want_values, atol=1e-5, rtol=0)
    if top >= 5:
        assert ids[0, :5].cpu().tolist() == [100, 9000, 16999, 8191, 8192]
        assert ids[1, :5].cpu().tolist() == [0, 1, 2, 3, 4]


def test_bad_arguments_are_refused():
    logits = torch.zeros(2, 10)
    with pytest.raises(ValueError, match="0..32"):
        row_logprobs(logits, torch.tensor([0]), torch.tensor([1]), 33)
    with pytest.raises(ValueError, match="contiguous rows"):
        row_logprobs(logits.t(), torch.tensor([0]), torch.tensor([1]), 1)
