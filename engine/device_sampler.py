"""Which rows of a step are drawn by the batched device sampler (kernels/sampling.py).

On CUDA, every sampled row (temperature > 0) that needs no log-probs is drawn in
one batched call instead of one `torch.multinomial` (and its host sync) per
row; rows that need log-probs keep the host sampler. The seed of a row is the
runner's per-(request, position) seed, so a draw depends only on the request's
seed and the token's position.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def draw_on_device(
    chunks, logits: torch.Tensor, spans: list[tuple[int, int]], row_seed: Callable[[object], int]
) -> dict[int, int]:
    """{chunk index: token} for the rows this sampler takes; empty off CUDA."""
    from splitserve import kernels

    if not logits.is_cuda or not kernels.triton_available():
        return {}
    picked = []
    for i, chunk in enumerate(chunks):
        params = chunk.request.params
        if chunk.is_sample and not params.is_greedy and not params.return_log_probs and not params.top_n_logprobs:
            picked.append(i)
    if not picked:
        return {}
    reqs = [chunks[i].request for i in picked]
    table = torch.tensor(
        [[spans[i][1] - 1, r.params.top_k, row_seed(r)] for i, r in zip(picked, reqs, strict=True)], dtype=torch.long
    ).to(logits.device, non_blocking=True)
    floats = torch.tensor([[r.params.temperature, r.params.top_p] for r in reqs], dtype=torch.float32)
    floats = floats.to(logits.device, non_blocking=True)
    vocab = logits.shape[1]
    ks = [r.params.top_k for r in reqs if 0 < r.params.top_k < vocab]
    any_p = any(0.0 < r.params.top_p < 1.0 for r in reqs)
    tokens = kernels.sample_rows(logits[table[:, 0]], floats[:, 0], table[:, 1], floats[:, 1], table[:, 2],
                                 max_top_k=max(ks, default=0), any_top_p=any_p)
    return dict(zip(picked, tokens.tolist(), strict=True))
