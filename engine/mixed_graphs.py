"""CUDA graphs for steps that carry prefill chunks, up to a token budget.

Aggregated serving mixes each new prompt's chunks into the running decodes; such a step ran
eagerly, and eagerly a small model's step is bound by the host launching ~15 kernels a layer.
Here a step of at most `max_tokens` tokens (chunks of any length, decodes included) replays a
graph of the forward pass instead:

    embed -> layers (fused rotary + KV write, paged prefill attention over each sequence's
    blocks: kernels/paged_prefill.py, whose grid depends on shapes only) -> hidden [tokens, H]

The graph stops at the hidden states: which rows get logits (chunk ends, prompt log-probs)
changes per step, so `ModelRunner.collect` computes them eagerly as after an eager step.

One graph per (token bucket, sequence bucket, context bucket), captured on first use:
tokens 16, 32, …, `max_tokens`; sequences 2, 4, …, the decode graphs' largest batch; context
widths as the decode graphs' (cuda_graphs.context_buckets). The static inputs are one int64
buffer filled by one copy from a pinned twin:

    [ids (T) | positions (T) | slots (T) | q_starts (S + 1) | ctx_lens (S) | tables (S x W)]

Padding: the T - n tokens after the real ones form one extra sequence over the scratch block
(context = its length, every table entry the scratch block), so they write and
read only memory no request owns; the sequences after it are empty (q_len 0). A mixed step is
never left in flight (engine/step_pipeline.py), so one pinned twin suffices: the next mixed
step is launched only after this one was collected.
"""

from __future__ import annotations

import numpy as np
import torch

from splitserve.engine.attention import AttentionMetadata
from splitserve.engine.cuda_graphs import capture

FIRST_TOKEN_BUCKET = 16


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, … below `max_tokens`, then `max_tokens`."""
    sizes, t = [], FIRST_TOKEN_BUCKET
    while t < max_tokens:
        sizes.append(t)
        t *= 2
    return [*sizes, max_tokens]


def split(buf, tokens: int, seqs: int, width: int):
    """(ids, positions, slots, q_starts, ctx_lens, tables) views of a bucket's input buffer."""
    t, s = tokens, seqs
    return (buf[:t], buf[t : 2 * t], buf[2 * t : 3 * t], buf[3 * t : 3 * t + s + 1],
            buf[3 * t + s + 1 : 3 * t + 2 * s + 1], buf[3 * t + 2 * s + 1 :].reshape(s, width))


def fill(views, chunks, block_size: int, scratch_block: int) -> None:
    """Write a step's inputs into a bucket's host views (numpy), padding included (see the module
    docstring); `chunks` may be empty (all padding, as captured)."""
    ids, positions, slots, q_starts, ctx_lens, tables = views
    bs, tokens = block_size, len(ids)
    tables.fill(scratch_block)
    offset = 0
    for i, chunk in enumerate(chunks):
        req, start, n = chunk.request, chunk.start, chunk.num_tokens
        end = start + n
        pos = np.arange(start, end)
        blocks = np.asarray(req.block_ids[: -(-end // bs)])
        ids[offset : offset + n] = req.token_slice(start, end)
        positions[offset : offset + n] = pos
        slots[offset : offset + n] = blocks[pos // bs] * bs + pos % bs
        tables[i, : len(blocks)] = blocks
        q_starts[i] = offset
        ctx_lens[i] = end
        offset += n
    pad = tokens - offset  # the padding sequence, over the scratch block
    ids[offset:] = 0
    positions[offset:] = np.arange(pad) % bs  # any position is harmless; these stay inside every rotary table
    slots[offset:] = scratch_block * bs + np.arange(pad) % bs
    q_starts[len(chunks)] = offset
    q_starts[len(chunks) + 1 :] = tokens
    ctx_lens[len(chunks)] = max(pad, 1)
    ctx_lens[len(chunks) + 1 :] = 1


class _Mixed:
    """One captured bucket: its input buffer, pinned twin, output and graph."""

    def __init__(self, tokens: int, seqs: int, width: int, device: torch.device):
        self.tokens, self.seqs, self.width = tokens, seqs, width
        size = 3 * tokens + 2 * seqs + 1 + seqs * width
        self.buffer = torch.zeros(size, dtype=torch.long, device=device)
        self.host = torch.zeros(size, dtype=torch.long).pin_memory()
        self.views = split(self.host.numpy(), tokens, seqs, width)
        self.hidden: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None


class MixedGraphs:
    def __init__(self, decode, max_tokens: int):
        """`decode`: the engine's `DecodeGraphs`, whose model, KV, scratch block, batch and context
        buckets these graphs share."""
        self.model, self.kv_caches = decode.model, decode.kv_caches
        self.scratch_block, self.block_size = decode.scratch_block, decode.block_size
        self.seq_buckets, self.block_buckets = decode.buckets, decode.block_buckets
        # the padding sequence (up to a bucket's tokens) must fit the narrowest block table
        self.token_buckets = token_buckets(min(max_tokens, self.block_buckets[0] * self.block_size))
        self._static: dict[tuple[int, int, int], _Mixed] = {}
        self._pool = None

    def can_run(self, out) -> bool:
        """A step of at most the token budget, one sequence fewer than the largest bucket (the
        padding sequence), every context within the widest bucket."""
        chunks = out.chunks
        if not chunks or len(chunks) >= self.seq_buckets[-1] or out.num_tokens > self.token_buckets[-1]:
            return False
        limit = self.block_buckets[-1] * self.block_size
        return all(c.start + c.num_tokens <= limit for c in chunks)

    def launch(self, out) -> torch.Tensor:
        """Replay the bucket's graph for the step; returns the hidden states [tokens, H] (a graph
        buffer: valid until this bucket replays again), without waiting for them."""
        chunks, bs = out.chunks, self.block_size
        num_tokens = out.num_tokens
        longest = max(-(-(c.start + c.num_tokens) // bs) for c in chunks)
        static = self._get(
            next(t for t in self.token_buckets if t >= num_tokens),
            next(s for s in self.seq_buckets if s > len(chunks)),
            next(w for w in self.block_buckets if w >= longest),
        )
        fill(static.views, chunks, bs, self.scratch_block)
        static.buffer.copy_(static.host, non_blocking=True)
        static.graph.replay()
        return static.hidden[:num_tokens]

    def reset(self) -> None:
        """Drop every graph (the KV pointers are about to change); re-captured on use."""
        self._static.clear()
        self._pool = None

    def capture_narrowest(self) -> int:
        """Capture every (token, sequence) bucket a step can use at the narrowest context width,
        before serving (engine/warmup.py); returns how many were not captured yet. A step of
        n chunks uses the first sequence bucket above n, and n <= its tokens: so sequence
        buckets up to twice the token bucket. Wider contexts stay captured on first use."""
        width, new = self.block_buckets[0], 0
        for tokens in self.token_buckets:
            for seqs in self.seq_buckets:
                if seqs <= 2 * tokens and (tokens, seqs, width) not in self._static:
                    self._get(tokens, seqs, width)
                    new += 1
        return new

    def _get(self, tokens: int, seqs: int, width: int) -> _Mixed:
        key = (tokens, seqs, width)
        static = self._static.get(key)
        if static is None:
            static = self._static[key] = self._capture(tokens, seqs, width)
        return static

    @torch.inference_mode()
    def _capture(self, tokens: int, seqs: int, width: int) -> _Mixed:
        static = _Mixed(tokens, seqs, width, self.kv_caches[0].device)
        fill(static.views, (), self.block_size, self.scratch_block)
        static.buffer.copy_(static.host)
        ids, positions, slots, q_starts, ctx_lens, tables = split(static.buffer, tokens, seqs, width)
        meta = AttentionMetadata(
            slot_mapping=slots, backend="triton", block_tables=tables, q_starts=q_starts, ctx_lens=ctx_lens
        )
        static.graph, static.hidden = capture(
            lambda: self.model(positions, meta, self.kv_caches, input_ids=ids), self._pool
        )
        self._pool = static.graph.pool()
        return static
