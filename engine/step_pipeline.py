"""Async scheduling: launch decode step N+1 before step N's tokens reach the host.

A decode step on a GPU is short (about a millisecond for a 1B model), and the
host work around it — scheduling, batch building, stop checks, result objects —
is of the same order. Done serially the two add up; here they overlap:

    host:  schedule N+1 | launch N+1 | collect N, stop checks, outputs N | schedule N+2 ...
    GPU:        ... step N ...       |        ... step N+1 ...          |

Step N+1's input ids are step N's sampled tokens, still on the device (`feed`);
on the host each request carries a placeholder token until N is collected. The
scheduler only counts tokens, so it can plan N+1 with the placeholder in place;
prefix-cache registration (which hashes token ids) waits for the real token.

Scheduling ahead is safe only when it cannot change which requests run, so
`Engine.step` keeps a step in flight only when

- it is decode-only, every running request is in it, and each row's token is
  already on the device — the argmax the step computed, or for a sampled row the
  draw queued right behind it (`ModelRunner._draw_at_launch`) — and so are the
  log-probs of each row that wants them (engine/step_logprobs.py; not for the
  processed log-probs of sampled or adjusted rows);
- nothing waits for admission and the pool has a free block for each request
  (no preemption can hit a request that holds a placeholder);
- the engine is one rank, not a prefill engine (prefill requests end after one
  token anyway);
- a row guided by a schema or grammar (engine/guided.py) wants only its token (no log-probs,
  no bias / penalties) and is greedy, or sampled where the device sampler draws (CUDA): its mask
  needs the token before it, so its token is taken by `ModelRunner.settle_guided` once step N-1
  is applied — the mask filled while step N runs on the device, the masked argmax / draw queued
  behind it — and step N+1 is fed that token as any other.

Otherwise the step in flight is collected first and the engine steps plainly.
A request that finishes at step N (EOS, stop string, length) was already
computed in step N+1: that row is dropped (its KV write lands in blocks freed
with the request, ordered on the device stream before any later reuse).
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.step_logprobs import wants_logprobs

PLACEHOLDER = -1
"""Stands for a token still on the device; never fed to the model (see `feed`)."""


@dataclass
class Inflight:
    out: object
    """The step's `SchedulerOutput`."""
    pending: object
    """The runner's `PendingStep`; `.greedy` holds the tokens on the device."""


def can_run_ahead(engine, out, pending) -> bool:
    """May `out` stay in flight while the next step is scheduled? `pending`: the runner's
    `PendingStep` of `out` (its `drawn` rows had their sampled token drawn at launch)."""
    if not engine.async_scheduling or engine.ps.world_size != 1 or engine.config.role == "prefill":
        return False
    sched = engine.scheduler
    if sched.waiting or not out.chunks:
        return False
    alive = 0
    logprob_rows = frozenset(pending.logprobs.chunks) if pending.logprobs is not None else frozenset()
    for i, chunk in enumerate(out.chunks):
        req = chunk.request
        if req.status.is_finished:
            continue
        alive += 1
        params = req.params
        if chunk.num_tokens != 1 or not chunk.is_sample:
            return False
        if params.is_guided:  # its token is taken by `settle_guided` before the next launch
            if req.guide is None or pending.logits is None or not engine.runner.settles_guided(params):
                return False
            continue
        if not (params.is_greedy or i in pending.drawn) or (wants_logprobs(params) and i not in logprob_rows):
            return False
    return alive > 0 and alive == len(sched.running) and engine.pool.num_available >= alive


def same_requests(engine, prev: Inflight) -> bool:
    """The running set is exactly `prev`'s rows, in order, none finished, with room to
    grow: the next step's row i is then fed row i of `prev`'s sampled tokens."""
    sched = engine.scheduler
    if sched.waiting or engine.pool.num_available < len(sched.running):
        return False
    rows = [c.request for c in prev.out.chunks]  # a finished row would shift the fed ids: no
    return len(rows) == len(sched.running) and all(
        a is b and not a.status.is_finished for a, b in zip(rows, sched.running, strict=True)
    )


def advance(out) -> None:
    """Mark `out`'s live requests as one token further, that token still on the device."""
    for chunk in out.chunks:
        req = chunk.request
        if req.status.is_finished:
            continue
        req.num_computed_tokens = chunk.start + 1
        req.output_token_ids.append(PLACEHOLDER)
