"""The logit-adjustment kernel (kernels/logit_adjust.py) against its torch form
(engine/logit_slots.py `apply_torch`) and against OpenAI's formula written densely, over steps that
count new ids (repeated ones too) and fed tokens into per-slot counts; greedy rows' argmax taken
in the same pass (ties: the first index, as torch.argmax)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from splitserve.engine.logit_slots import HEADER, apply_torch  # noqa: E402
from splitserve.kernels.logit_adjust import HEADER as KERNEL_HEADER  # noqa: E402
from splitserve.kernels.logit_adjust import adjust_logit_rows  # noqa: E402

VOCAB = 17000  # three parts of the vocabulary (8192 each, the last one short)


def dense(logits, freq, pres, bias, output_ids):
    """logit[j] - (frequency * count[j] + presence * [count[j] > 0]) + bias[j], in float64."""
    counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=VOCAB).double()
    return logits.double() - (freq * counts + pres * (counts > 0).double()) + bias.double()


def test_the_kernel_equals_the_torch_form_and_the_formula_over_steps(device):
    g = torch.Generator().manual_seed(0)
    bias = torch.zeros(3, VOCAB)
    bias[0, [5, 9]] = torch.tensor([2.5, -1.0])
    bias[2, 16999] = -100.0
    # slot: (frequency, presence); rows of each step: (logit row, slot, new ids, fed token or None);
    # rows 0 and 2 of a step are greedy (their argmax written to tokens[row])
    penalties = {0: (1.3, 0.7), 1: (0.5, 0.0), 2: (-0.25, 2.0)}
    long_ids = torch.randint(0, VOCAB, (1200,), generator=g).tolist()  # > one block of new ids, repeats
    steps = [
        [(0, 0, [5, 7, 7, 11, 8200], None), (3, 2, long_ids, 16999)],
        [(1, 0, [], 7), (2, 1, [3, 3, 4], 4)],  # fed tokens: one already counted, one new to the slot
        [(5, 1, [4, 12000], None), (0, 2, [], 16998)],
    ]
    outputs = {s: [] for s in penalties}
    ref_counts, ref_bias = torch.zeros(3, VOCAB), bias.clone()
    counts, bias_dev = ref_counts.clone().to(device), bias.clone().to(device)
    for rows in steps:
        logits = torch.randn(6, VOCAB, generator=g)
        logits[0, [100, 1124, 9000]] = 50.0  # a tie (1124: 100's lane; 9000: another part): the first wins
        fed = torch.zeros(len(rows), dtype=torch.long)
        want_tokens, got_tokens = torch.full((6,), -7), torch.full((6,), -7, device=device)
        head, new = [], []
        for r, (row, slot, ids, fed_token) in enumerate(rows):
            if fed_token is not None:
                fed[r] = fed_token
            head += [row, slot, r if fed_token is not None else -1, *penalties[slot], len(new), len(new) + len(ids),
                     row if row in (0, 2) else -1]  # fmt: skip
            new += ids
            outputs[slot] += ids + ([fed_token] if fed_token is not None else [])
        table = torch.tensor(head + new, dtype=torch.float64)
        want = logits.clone()
        apply_torch(want, ref_counts, ref_bias, table, len(rows), fed, want_tokens)
        got = logits.clone().to(device)
        adjust_logit_rows(got, counts, bias_dev, table.to(device), len(rows), fed.to(device), got_tokens)
        greedy = [row for row, *_ in rows if row in (0, 2)]
        assert got_tokens.tolist() == want_tokens.tolist()
        assert [want_tokens[r].item() for r in greedy] == [want[r].argmax().item() for r in greedy]
        assert all(t == -7 for r, t in enumerate(want_tokens.tolist()) if r not in greedy)
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-5)  # (a GPU may fuse a multiply-add)
        torch.testing.assert_close(counts.cpu(), ref_counts, rtol=0, atol=0)
        if device.type == "cpu":
            assert torch.equal(got, want)
        touched = {row for row, *_ in rows}
        for row in range(6):
            if row not in touched:
                assert torch.equal(got[row].cpu(), logits[row])
        for row, slot, _, _ in rows:
            freq, pres = penalties[slot]
            torch.testing.assert_close(want[row].double(), dense(logits[row], freq, pres, bias[slot], outputs[slot]),
                                       rtol=0, atol=1e-4)  # fmt: skip


def test_bf16_logits_and_no_fed_tokens(device):
    counts, bias = torch.zeros(1, VOCAB), torch.zeros(1, VOCAB)
    bias[0, 3] = 1.0
    table = torch.tensor([1, 0, -1, 0.5, 0.0, 0, 3, -1, 3, 3, 8], dtype=torch.float64)
    logits = torch.zeros(2, VOCAB, dtype=torch.bfloat16)
    want = logits.clone()
    apply_torch(want, counts.clone(), bias, table, 1)
    got = logits.clone().to(device)
    adjust_logit_rows(got, counts.to(device), bias.to(device), table.to(device), 1)
    assert torch.equal(got.cpu(), want)
    assert (want[1, 3].item(), want[1, 8].item(), want[0].abs().sum().item()) == (0.0, -0.5, 0.0)


def test_the_engine_builds_the_header_the_kernel_reads():
    assert HEADER == KERNEL_HEADER


def test_bad_arguments_are_refused(device):
    rows = torch.zeros(1, 4, device=device)
    with pytest.raises(ValueError, match="float64"):
        adjust_logit_rows(rows, rows.clone(), rows.clone(), torch.zeros(8, device=device), 1)
    with pytest.raises(ValueError, match="counts must be float32"):
        adjust_logit_rows(rows, torch.zeros(1, 5, device=device), rows, torch.zeros(8, dtype=torch.float64), 1)
