"""Batched sampling on the device: temperature, top-k, top-p and a seeded draw for
every sampled row of a step at once, with no host round trip per row.

    logits [N, V] float32, temperature / top_k / top_p / seeds [N] -> token ids [N] int64

Temperature and the top-k / top-p masks are batched torch ops (one `topk` with the
largest k of the batch, one `sort` only when some row uses top-p). The draw is the
Gumbel-max trick — argmax(x + g), g = -log(-log(u)) — with u from Triton's Philox
generator keyed by (row seed, vocabulary index): a token depends only on its
request's seed and position (folded into `seeds` by the caller) and never on the
batch it ran in. Two launches, like `argmax.py`.

The host-side sampler (engine/sampler.py, torch.multinomial) remains the CPU path
and the path of rows that need log-probs; a given device type always draws the same
tokens for the same seed, so prefill and decode engines on GPUs agree.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cdiv, check_last_dim_contiguous, next_power_of_2
from .argmax import _merge_argmax_kernel

__all__ = ["mask_logits", "sample_rows"]

_BLOCK = 4096


def mask_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, *,
    max_top_k: int | None = None, any_top_p: bool | None = None,
) -> torch.Tensor:
    """Temperature, then top-k (k <= 0 or >= V: off), then top-p (p outside (0, 1): off), as
    engine/sampler.process_logits does for one row; masked entries are -inf.

    `max_top_k` (largest active k, 0 for none) and `any_top_p` are what the caller knows
    from the requests' parameters; passing them avoids reading them back from the device.
    When every top-p row also has a top-k, top-p works on the `topk` values (already
    sorted) instead of sorting the whole vocabulary."""
    x = logits / temperature[:, None]
    vocab = x.shape[1]
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = (top_p > 0) & (top_p < 1)
    if max_top_k is None:
        max_top_k = int(torch.where(use_k, top_k, 0).max()) if len(top_k) else 0
    if any_top_p is None:
        any_top_p = bool(use_p.any())
    values = None
    if max_top_k > 0:
        values = torch.topk(x, max_top_k, dim=-1).values  # [N, max_k], descending
        k = torch.where(use_k, top_k, max_top_k)
        kth = values.gather(1, (k - 1)[:, None])
        x = x.masked_fill((x < kth) & use_k[:, None], float("-inf"))
        values = values.masked_fill(torch.arange(max_top_k, device=x.device)[None, :] >= k[:, None], float("-inf"))
    if not any_top_p:
        return x
    if values is not None and bool((use_k | ~use_p).all()):
        sorted_x = values  # each top-p row's kept set lies in its own top-k values
    else:
        sorted_x = torch.sort(x, dim=-1, descending=True).values
    probs = torch.softmax(sorted_x, dim=-1)
    drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p[:, None]
    drop[:, 0] = False
    cutoff = torch.where(drop | torch.isinf(sorted_x), float("inf"), sorted_x).min(dim=-1).values
    return x.masked_fill((x < cutoff[:, None]) & use_p[:, None], float("-inf"))


@triton.jit
def _partial_gumbel_argmax(x_ptr, seeds_ptr, part_val_ptr, part_idx_ptr, stride_x, vocab, num_parts, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=float("-inf")).to(tl.float32)
    seed = tl.load(seeds_ptr + row)
    u = tl.rand(seed, offs)
    g = -tl.log(-tl.log(u + 1e-20) + 1e-20)
    y = tl.where(mask, x + g, float("-inf"))
    best = tl.max(y, 0)
    idx = tl.min(tl.where(y == best, offs, vocab), 0)
    tl.store(part_val_ptr + row * num_parts + part, best)
    tl.store(part_idx_ptr + row * num_parts + part, idx)


def sample_rows(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor,
    *, max_top_k: int | None = None, any_top_p: bool | None = None,
) -> torch.Tensor:
    """One token per row. Every row must have temperature > 0 (greedy rows are an argmax
    elsewhere; the caller checks, on the host). `seeds` int64 [N] (folded with the output
    position by the caller); `max_top_k` / `any_top_p` as in `mask_logits`."""
    if logits.dim() != 2 or not (len(temperature) == len(top_k) == len(top_p) == len(seeds) == logits.shape[0]):
        raise ValueError(f"logits [N, V] and four [N] parameter tensors expected, got {tuple(logits.shape)}")
    x = mask_logits(logits.float(), temperature.float(), top_k, top_p, max_top_k=max_top_k, any_top_p=any_top_p)
    x = x.contiguous()
    check_last_dim_contiguous("logits", x)
    n, vocab = x.shape
    out = torch.empty(n, dtype=torch.long, device=x.device)
    if n == 0:
        return out
    block = min(_BLOCK, next_power_of_2(vocab))
    parts = cdiv(vocab, block)
    part_val = torch.empty(n, parts, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(n, parts, dtype=torch.int32, device=x.device)
    _partial_gumbel_argmax[(n, parts)](x, seeds, part_val, part_idx, x.stride(0), vocab, parts, BLOCK=block,
                                       num_warps=8 if block >= 2048 else 4)
    _merge_argmax_kernel[(n,)](part_val, part_idx, out, parts, vocab, BLOCK_P=next_power_of_2(parts), num_warps=1)
    return out
