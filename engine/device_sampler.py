"""Which rows of a step are drawn by the batched device sampler (kernels/sampling.py).

On CUDA, every sampled row (temperature > 0) is drawn in one batched call
instead of one `torch.multinomial` (and its host sync) per row — also rows
that want the log-probs of the model's own logits, computed beside the draw
(engine/step_logprobs.py); rows that want processed log-probs, or log-probs
with a logit bias / penalties, keep the host sampler. The seed of a row is the
runner's per-(request, position) seed, so a draw depends only on the request's
seed and the token's position.

`draw_rows` queues the draw and returns the tokens on the device without waiting
for them: a decode step draws its sampled rows right after its logits, so the
step can stay in flight like a greedy one (engine/step_pipeline.py). Its row
parameters reach the device from pinned memory (a copy from pageable memory
would wait for the stream, i.e. for the step itself).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch

from splitserve.engine.devices import to_device
from splitserve.engine.step_logprobs import on_device, wants_logprobs


def device_draws(params, logprobs_mode: str) -> bool:
    """A sampled row the batched sampler may draw: its token alone is wanted (a row with a logit
    bias or penalties from its logits adjusted in place first: engine/adjusted_rows.py), or
    also log-probs the device computes beside the draw (engine/step_logprobs.py)."""
    return not params.is_greedy and not params.is_guided and (not wants_logprobs(params) or on_device(params, logprobs_mode))


def mask_flags(params: Sequence, vocab: int) -> tuple[int, bool, bool]:
    """What `kernels.sample_rows` needs known of a batch's masks, from the host-side params:
    (largest active top-k, any active top-p, every top-p row also top-k)."""
    uses_k = [0 < p.top_k < vocab for p in params]
    uses_p = [0.0 < p.top_p < 1.0 for p in params]
    max_top_k = max((p.top_k for p, k in zip(params, uses_k, strict=True) if k), default=0)
    return max_top_k, any(uses_p), all(k or not p for k, p in zip(uses_k, uses_p, strict=True))


def draw_rows(
    chunks, logits: torch.Tensor, spans: list[tuple[int, int]], row_seed: Callable[[object], int],
    picked: Sequence[int],
) -> torch.Tensor:
    """Tokens [len(picked)] int64 on the logits' device for chunks `picked` (sampled rows: each
    satisfies `device_draws`, or is a row adjusted at launch after its log-probs were taken),
    drawn from the last row of each one's span; no host sync."""
    from splitserve import kernels

    reqs = [chunks[i].request for i in picked]
    table = to_device([[spans[i][1] - 1, r.params.top_k, row_seed(r)] for i, r in zip(picked, reqs, strict=True)],
                    torch.long, logits.device)
    floats = to_device([[r.params.temperature, r.params.top_p] for r in reqs], torch.float32, logits.device)
    max_top_k, any_top_p, within = mask_flags([r.params for r in reqs], logits.shape[1])
    return kernels.sample_rows(logits, floats[:, 0], table[:, 1], floats[:, 1], table[:, 2], rows=table[:, 0],
                               max_top_k=max_top_k, any_top_p=any_top_p, top_p_within_top_k=within)


def sampled_rows(chunks, logprobs_mode: str, skip: Collection[int] = ()) -> list[int]:
    """The chunks of a step (but `skip`) whose token may be drawn apart from their log-probs
    (`device_draws`)."""
    return [i for i, chunk in enumerate(chunks)
            if i not in skip and chunk.is_sample and device_draws(chunk.request.params, logprobs_mode)]


def device_drawable(chunks, logits: torch.Tensor, logprobs_mode: str, skip: Collection[int] = ()) -> list[int]:
    """The chunks of a step the batched device sampler draws: none off CUDA or without Triton."""
    from splitserve import kernels

    if not logits.is_cuda or not kernels.triton_available():
        return []
    return sampled_rows(chunks, logprobs_mode, skip)


def draw_on_device(
    chunks, logits: torch.Tensor, spans: list[tuple[int, int]], row_seed: Callable[[object], int],
    logprobs_mode: str, skip: Collection[int] = (),
) -> dict[int, int]:
    """{chunk index: token} for the rows this sampler takes (but `skip`); empty off CUDA."""
    picked = device_drawable(chunks, logits, logprobs_mode, skip)
    if not picked:
        return {}
    tokens = draw_rows(chunks, logits, spans, row_seed, picked)
    return dict(zip(picked, tokens.tolist(), strict=True))
