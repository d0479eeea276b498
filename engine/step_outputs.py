"""What a step produced: sampled tokens appended, stop checks run, requests finished.

Shared by the engine (engine.py) and the simulated engine (sim_engine.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from splitserve.engine.request import GenerationResult, RequestStatus


@dataclass(frozen=True)
class StepOutput:
    """One request's progress in one step."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    result: GenerationResult | None
    """The request's state after the step. With the engine's `snapshot_outputs` off, only a
    finished request's output and a request's first generated token carry one (a snapshot
    copies every list of the request: O(tokens) a request a step); the fields below say
    what the step added either way."""
    num_generated: int = 0
    """Tokens the request has generated so far, this step's included."""
    new_log_probs: tuple[float, ...] = ()
    """The new tokens' log-probs (when the request asked for them)."""
    new_top_n: tuple[dict[int, float], ...] = ()
    """The new tokens' top-n log-probs (when the request asked for them)."""


def apply_results(engine, out, results, ahead: bool) -> list[StepOutput]:
    """Append sampled tokens, run stop checks, finish requests. `ahead`: the step
    ran with placeholders (step_pipeline.py) whose bookkeeping is done here."""
    outputs = []
    guided: list[tuple[object, int]] = []
    now = time.monotonic()
    for chunk, res in zip(out.chunks, results, strict=True):
        req = chunk.request
        if req.status.is_finished:  # aborted, or ended a step earlier (a dropped row)
            continue
        if ahead:
            req.output_token_ids.pop()  # the placeholder
            engine.scheduler.update_computed(req, chunk.start + chunk.num_tokens)
        req.prompt_log_probs.extend(res.prompt_log_probs)
        req.prompt_top_logprobs.extend(res.prompt_top_logprobs)
        if res.sample is None:
            continue
        token = res.sample.token_id
        req.output_token_ids.append(token)
        if req.guide is not None:  # its matchers take their tokens together, below
            guided.append((req.guide, token))
        is_first = req.first_token_time is None
        if is_first:
            req.first_token_time = now
        log_probs = (res.sample.logprob,) if req.params.return_log_probs else ()
        req.generated_log_probs.extend(log_probs)
        top_n = (res.sample.top_n,) if res.sample.top_n is not None else ()
        req.top_n_logprobs.extend(top_n)
        delta, status = engine._stops[req.request_id].on_token(token)
        if status is None and engine.config.role == "prefill":
            status = RequestStatus.HANDOFF
        if status is not None:
            engine._finish(req, status, res.sample.logprob)
        is_finished = req.status.is_finished
        snapshot = is_finished or engine.snapshot_outputs or is_first
        result = GenerationResult.from_request(req, is_finished) if snapshot else None
        outputs.append(StepOutput(req.request_id, (token,), delta, result, len(req.output_token_ids), log_probs, top_n))
    if guided:
        from splitserve.engine.guided import consume_tokens

        runner = getattr(engine, "runner", None)
        consume_tokens(guided, parallel=runner is not None and runner.device.type == "cuda")
    return outputs
