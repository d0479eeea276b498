"""Rows with a logit bias or penalties, adjusted in place in a step's logits before any token is
taken from them — so the step's argmax, the batched device draw and the captured sampler graphs
all see the adjusted rows, and a decode step with such rows can still run ahead.

A decode step launched ahead (engine/step_pipeline.py) has its rows' previous token only on the
device: the host holds a placeholder for it. That token is the step's input id for the row, so
the counts a penalty needs are the host-known output plus that one id (`fed`), added on the
device; no host sync. Rows that want log-probs are left alone — sampled on the host from the
model's own logits (raw log-probs), adjusting a copy (engine/logit_slots.py `adjust_once`) —
except, in `raw_logprobs` mode, in a decode step's launch, which takes their raw log-softmax
first and then adjusts them with the others (`also`; engine/step_logprobs.py).

Each request's counts and bias live on the device (engine/logit_slots.py): a step sends the ids
its rows produced since their last adjustment, and one kernel launch adjusts every row
(kernels/logit_adjust.py; the same arithmetic in torch on the CPU).

    launch (decode-only step)           collect (steps with prefill chunks)
    adjust rows (fed), greedy rows'     adjust_in_place(rows not yet adjusted), then
      argmax into the step's tokens     argmax / device draw / host draw from the adjusted rows
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from splitserve.engine.logit_slots import LogitSlots
from splitserve.engine.step_logprobs import wants_logprobs


def adjusts_in_place(params) -> bool:
    """A row adjusted in the step's logits: a bias or penalty, and no log-probs wanted."""
    return params.adjusts_logits and not wants_logprobs(params)


def adjusted_rows(chunks, skip: Collection[int] = ()) -> list[int]:
    """The chunks of a step (but `skip`) that sample a token from in-place adjusted logits."""
    rows = []
    for i, chunk in enumerate(chunks):  # per decode step over the whole batch: the cheap test first
        params = chunk.request.params
        if params.adjusts_logits and adjusts_in_place(params) and chunk.is_sample and i not in skip \
                and not params.is_guided:  # a guided row is adjusted and masked on the host (engine/guided.py)
            rows.append(i)
    return rows


def adjust_in_place(
    slots: LogitSlots, logits: torch.Tensor, chunks, picked: Sequence[int], rows: Sequence[int],
    fed: torch.Tensor | None = None,
) -> None:
    """Adjust logits row `rows[j]` for chunk `picked[j]`. `fed` [num chunks] (a step launched
    ahead): each chunk's previous token on the device, counted where its request's output ends
    in a placeholder."""
    slots.adjust(logits, [(row, chunks[i].request, i, -1) for row, i in zip(rows, picked, strict=True)], fed)


def adjust_at_launch(
    slots: LogitSlots, chunks, logits: torch.Tensor, tokens: torch.Tensor, fed: torch.Tensor | None,
    also: Collection[int] = (),
) -> frozenset[int]:
    """A decode step's rows (row i = chunk i) with a bias or penalties and no log-probs, and the
    rows `also` (whose raw log-probs the caller has taken): adjusted in `logits` now, the greedy
    ones' argmax into `tokens` (the step's tokens on the device) — the step can then run ahead
    like any other. Returns the adjusted rows."""
    picked = sorted(set(adjusted_rows(chunks)) | set(also))
    if not picked:
        return frozenset()
    rows = [(i, chunks[i].request, i, i if chunks[i].request.params.is_greedy else -1) for i in picked]
    slots.adjust(logits, rows, fed, tokens)  # (a greedy row's argmax taken in the same pass)
    return frozenset(picked)
