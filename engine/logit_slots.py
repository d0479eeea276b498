"""Per-request state of logit adjustments on the device: a slot per request with a bias or
penalties, holding how often each token occurs in its output so far (`counts`) and its logit
bias (`bias`), both [slots, vocab] float32 — so adjusting a row costs the host a few ids a step,
however long the output (kernels/logit_adjust.py has the arithmetic and the measurements).

A slot remembers how many of the request's output entries it has counted. Each adjustment adds
the entries since then: real ids from the host, and a trailing run-ahead placeholder (the token
still on the device) from the step's fed ids. Should the output ever be shorter than what was
counted, the slot counts again from zero. A slot is freed when its request object is (weakref):
nothing to release by hand, so none can leak; a step still in flight that reads the slot runs
before any later reuse on the same stream.

Memory: 8 bytes a vocabulary entry per slot (1 MB at 128k), for as many slots as requests were
adjusted at once; the tensors grow by doubling and are kept.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from splitserve import kernels
from splitserve.engine.devices import to_device

HEADER = 8  # kernels/logit_adjust.py's table header (that module needs triton; a test checks they agree)


class LogitSlots:
    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.counts = torch.zeros(0, vocab, dtype=torch.float32, device=device)
        self.bias = torch.zeros(0, vocab, dtype=torch.float32, device=device)
        self._free: list[int] = []
        self._held: dict[int, list[int]] = {}  # id(request) -> [slot, output entries counted]

    @property
    def num_held(self) -> int:
        return len(self._held)

    def adjust(
        self, logits: torch.Tensor, rows: Sequence[tuple[int, object, int, int]], fed: torch.Tensor | None,
        tokens: torch.Tensor | None = None,
    ) -> None:
        """Adjust `logits` rows for (logit row, request, fed index or -1, token index or -1) in
        place; a row with a token index writes its adjusted argmax to `tokens` there. A request's
        output ending in a placeholder needs its fed index (RuntimeError otherwise)."""
        head: list[float] = []
        new: list[float] = []
        for logit_row, req, fed_at, token_at in rows:
            slot, ids, pending = self._advance(req, fed is not None and fed_at >= 0)
            params = req.params
            start = len(new)
            new.extend(ids)
            head.extend((logit_row, slot, fed_at if pending else -1, params.frequency_penalty,
                         params.presence_penalty, start, len(new), token_at))  # fmt: skip
        if head:
            apply(logits, self.counts, self.bias, head + new, len(rows), fed, tokens)

    def _advance(self, req, can_feed: bool) -> tuple[int, list[int], bool]:
        """The request's slot, its output ids not yet counted there, and whether the output ends
        in a placeholder (to be counted from the fed ids; RuntimeError when `can_feed` is false,
        before anything is marked counted)."""
        held = self._held.get(id(req))
        if held is None:
            held = self._held[id(req)] = [self._take(req), 0]
        output = req.output_so_far()
        if len(output) < held[1]:
            self.counts[held[0]].zero_()
            held[1] = 0
        new = output[held[1] :]
        pending = bool(new) and new[-1] < 0
        ids = new[:-1] if pending else new
        if pending and not can_feed:
            raise RuntimeError("a request's last token is still on the device, but the step was not fed it")
        if any(t < 0 for t in ids):
            raise RuntimeError("a request's output holds a placeholder before its last token")
        held[1] = len(output)
        return held[0], ids, pending

    def _take(self, req) -> int:
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self.counts[slot].zero_()
        self.bias[slot].zero_()
        set_bias(self.bias[slot], req.params.logit_bias)
        weakref.finalize(req, self._release, id(req), slot)
        return slot

    def _release(self, key: int, slot: int) -> None:
        self._held.pop(key, None)
        self._free.append(slot)

    def _grow(self) -> None:
        old = self.counts.shape[0]
        size = max(4, 2 * old)
        self.counts = torch.cat([self.counts, self.counts.new_zeros(size - old, self.vocab)])
        self.bias = torch.cat([self.bias, self.bias.new_zeros(size - old, self.vocab)])
        self._free.extend(range(size - 1, old - 1, -1))


def set_bias(row: torch.Tensor, pairs: Sequence[tuple[int, float]]) -> None:
    """Write (token, bias) pairs into a zeroed bias row: one copy of each list to the device."""
    if pairs:
        tokens, values = zip(*pairs, strict=True)
        row[to_device(list(tokens), torch.long, row.device)] = to_device(list(values), torch.float32, row.device)


def apply(
    logits: torch.Tensor, counts: torch.Tensor, bias: torch.Tensor, table: list[float], num_rows: int,
    fed: torch.Tensor | None = None, tokens: torch.Tensor | None = None,
) -> None:
    """On a GPU one kernel launch after one copy of the table, elsewhere `apply_torch`."""
    if logits.is_cuda and kernels.triton_available():
        table_dev = to_device(table, torch.float64, logits.device)
        kernels.adjust_logit_rows(logits, counts, bias, table_dev, num_rows, fed, tokens)
    else:
        table_host = torch.tensor(table, dtype=torch.float64, device=logits.device)
        apply_torch(logits, counts, bias, table_host, num_rows, fed, tokens)


def apply_torch(
    logits: torch.Tensor, counts: torch.Tensor, bias: torch.Tensor, table: torch.Tensor, num_rows: int,
    fed: torch.Tensor | None = None, tokens: torch.Tensor | None = None,
) -> None:
    """The kernel's arithmetic in torch, row by row (the CPU path and the kernel's reference)."""
    heads = table[: num_rows * HEADER].view(num_rows, HEADER)
    new = table[num_rows * HEADER :].long()
    for head in heads:
        row, slot, fed_at, _, _, start, end, token_at = (int(v) for v in head.tolist())
        freq, pres = head[3].to(torch.float32), head[4].to(torch.float32)
        ids = new[start:end]
        if fed_at >= 0:
            ids = torch.cat([ids, fed[fed_at : fed_at + 1].long().to(ids.device)])
        counts[slot].index_add_(0, ids, torch.ones(len(ids), dtype=torch.float32, device=counts.device))
        c = counts[slot]
        delta = bias[slot] - (freq * c + pres * (c > 0).to(torch.float32))
        logits[row] = (logits[row].to(torch.float32) + delta).to(logits.dtype)
        if token_at >= 0:
            tokens[token_at] = logits[row].argmax()


def adjust_once(logits: torch.Tensor, params, output_ids: Sequence[int]) -> torch.Tensor:
    """One row [vocab] -> a new row with `params`' adjustments for `output_ids` (a throw-away
    slot: the host sampler's form, for rows that want log-probs of the model's own logits)."""
    vocab, device = logits.shape[-1], logits.device
    counts = torch.zeros(1, vocab, dtype=torch.float32, device=device)
    bias = torch.zeros(1, vocab, dtype=torch.float32, device=device)
    set_bias(bias[0], params.logit_bias)
    row = logits[None].clone()
    ids = [t for t in output_ids if t >= 0]
    apply(row, counts, bias, [0, 0, -1, params.frequency_penalty, params.presence_penalty, 0, len(ids), -1, *ids], 1)
    return row[0]
