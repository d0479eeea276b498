"""CUDA graphs for decode-only steps (the Triton attention backend, or FlashInfer's).

One graph per (batch-size bucket, context bucket), captured lazily the first
time a step of that shape runs. Batch buckets: 1, 2, 4, …, max. Context buckets:
2k tokens, then ×4 (8k, 32k, …) up to the longest graphed context — each sizes the
block tables and the decode kernel's context partitions, so a batch of short
contexts keeps a plan sized for them (at batch 64 the 2k bucket is not split: no
second attention launch per layer, ~7 µs a layer less than the 8k plan on the H200
at 640 tokens) while an 8k+ prompt's decode still replays a graph instead of
falling back to eager steps (~13 ms a step at batch 1 for the Llama-3.2-1B shape
on the H200, against ~1.2 ms replayed). Each graph owns static inputs and replays

    embed -> layers (write_kv + paged decode attention) -> norm -> lm_head -> logits [bucket, vocab]

A batch of B < bucket sequences is padded: the extra rows point at the scratch
block (position 0, context length 1), so they write and read only memory no
request owns. Graphs bake in the KV tensors' addresses: a lifecycle suspend
(which frees that memory) calls `reset`, and they are captured again on use.
With the flashinfer backend each graph owns a FlashInfer decode wrapper whose index
buffers it captured (attention_flashinfer.GraphDecode), planned again before each replay.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from splitserve import kernels
from splitserve.engine.attention import AttentionMetadata
from splitserve.engine.sampler_graphs import SamplerGraphs


@dataclass
class _Static:
    """A bucket's graph and its inputs: one int64 device buffer

        [ids (B) | positions (B) | slots (B) | ctx_lens (B) | keep (B) | tables (B x context bucket blocks)]

    filled by one non-blocking copy from a pinned host twin per step. The twins alternate: with
    async scheduling step N + 1 is launched before step N is collected, so the copy of step N
    may not have run yet when step N + 1 fills its inputs (another process time-slicing the GPU
    can hold it back for milliseconds); the twin step N + 1 writes is the one of step N - 1,
    whose tokens — queued after its copy — were waited for before step N + 1 was scheduled."""

    buffer: torch.Tensor
    hosts: tuple[torch.Tensor, torch.Tensor]
    template: torch.Tensor
    """Host buffer of an all-padding batch; each step starts its ids, positions, slots,
    context lengths and keep flags from a copy of it (the table rows are kept up to date by `_write_row`)."""
    pad: object = None
    """numpy view of the template's table rows (all padding), what `_write_row` resets rows to."""
    rows: tuple[list, list] = ((), ())
    """Per host twin and row: (block list, blocks written) of what its table row holds, or None
    (padding). A running request's block list only grows (or is replaced), so a row written two
    steps ago for the same list needs at most its new blocks — the whole-table copy per row
    per step was ~70 µs of host time at batch 64 × 640 tokens, more with longer contexts."""
    logits: torch.Tensor | None = None
    greedy: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None
    turn: int = 0
    """The host twin the next step fills."""
    sampler: SamplerGraphs | None = None
    """Captured sampler draws over `logits` (engine/sampler_graphs.py), made on first use."""
    flashinfer: object | None = None
    """flashinfer backend: the graph's `GraphDecode`, planned before each replay."""


_ROW_FIELDS = 5
"""ids, positions, slots, ctx_lens, keep: one int64 each per row, before the table rows."""

SKIP_UNREAD_LOGITS = True
"""Rows of a decode graph whose logits nobody reads (`SamplingParams.argmax_only`) are not stored by the LM
head (`kernels.decode_linear(..., keep_rows=)`): a batch-64 step of a 128k vocabulary writes
33 MB of fp32 logits, ~8 µs of an H200's bandwidth, for greedy rows that need only their argmax.
False stores every row (an A/B switch for benchmarks/decode_sweep.py; takes effect at capture)."""


def _fields(buf: torch.Tensor, bucket: int) -> tuple[torch.Tensor, ...]:
    """(ids, positions, slots, ctx_lens, keep, tables) views of a bucket's input buffer."""
    ids, positions, slots, ctx_lens, keep = buf[: _ROW_FIELDS * bucket].view(_ROW_FIELDS, bucket)
    return ids, positions, slots, ctx_lens, keep, buf[_ROW_FIELDS * bucket :].view(bucket, -1)


def _write_row(tables, rows: list, i: int, blocks: list[int], n: int, pad) -> None:
    """Make table row `i` hold `blocks[:n]` then padding; `rows[i]` says what it holds now."""
    held = rows[i]
    if held is not None and held[0] is blocks and held[1] <= n:  # the same list, grown: new blocks only
        if held[1] < n:
            tables[i, held[1] : n] = blocks[held[1] : n]
    else:
        if held is not None:
            tables[i] = pad[i]
        tables[i, :n] = blocks[:n]
    rows[i] = (blocks, n)


def _clear_rows(tables, rows: list, start: int, pad) -> None:
    """Rows from `start` on back to padding (the rows of this step's padding)."""
    for i in range(start, len(rows)):
        if rows[i] is not None:
            tables[i] = pad[i]
            rows[i] = None


def buckets_up_to(max_batch: int) -> list[int]:
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return [*sizes, max_batch]


FIRST_CONTEXT_BUCKET = 2048
"""Tokens of the smallest context bucket; the next ones are ×4 up to the largest."""


def context_buckets(max_blocks: int, block_size: int) -> list[int]:
    """Block-table widths of the context buckets: FIRST_CONTEXT_BUCKET tokens, ×4, …, max_blocks."""
    widths, width = [], -(-FIRST_CONTEXT_BUCKET // block_size)
    while width < max_blocks:
        widths.append(width)
        width *= 4
    return [*widths, max_blocks]


class DecodeGraphs:
    def __init__(self, model, kv_caches, *, max_batch: int, max_blocks: int, scratch_block: int, block_size: int,
                 flashinfer=None):
        self.model = model
        self.flashinfer = flashinfer
        """attention_flashinfer.Shape when attention is FlashInfer's, else None (Triton)."""
        self.kv_caches = kv_caches
        self.buckets = buckets_up_to(max_batch)
        self.max_blocks = max_blocks
        self.scratch_block = scratch_block
        self.block_size = block_size
        self.block_buckets = context_buckets(max_blocks, block_size)
        self._static: dict[tuple[int, int], _Static] = {}
        self._pool = None
        self._last: _Static | None = None
        self.sampler_graphs = os.environ.get("SPLITSERVE_SAMPLER_GRAPHS", "1") != "0"
        """Draw sampled rows from captured sampler graphs (`draw`); 0 = eager draws."""
        self.mixed = None
        """Graphs for steps with prefill chunks (engine/mixed_graphs.py `MixedGraphs`), or None."""
        self._fi_workspace: torch.Tensor | None = None
        """flashinfer backend: the float workspace every graph's wrapper shares."""

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def can_run(self, out) -> bool:
        """A decode-only step (one token per sequence) that fits the largest bucket."""
        chunks = out.chunks
        if len(chunks) > self.max_batch:
            return False
        limit = self.max_blocks * self.block_size
        return all(c.num_tokens == 1 and c.start < limit for c in chunks)

    def launch(self, out, fed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the bucket's graph for a decode-only step; returns (logits [B, vocab]
        float32, greedy ids [B]) on the device, without waiting for them.

        The inputs are written straight into the pinned host buffer (no per-field
        tensors, one host-to-device copy): the host work per sequence is a few
        list reads, which is what bounds a decode step at large batch. `fed`: the
        input ids as a device tensor, overriding the (placeholder) host ones."""
        chunks = out.chunks
        batch = len(chunks)
        bs = self.block_size
        longest = max(c.start for c in chunks) // bs + 1
        static = self._get(next(b for b in self.buckets if b >= batch), next(w for w in self.block_buckets if w >= longest))
        bucket = static.logits.shape[0]
        host, rows = static.hosts[static.turn], static.rows[static.turn]
        static.turn ^= 1
        head = _ROW_FIELDS * bucket
        host[:head].copy_(static.template[:head])
        ids, positions, slots, ctx_lens, keep, tables = (v.numpy() for v in _fields(host, bucket))
        for i, chunk in enumerate(chunks):
            req, pos = chunk.request, chunk.start
            blocks = req.block_ids
            n = pos // bs + 1
            ids[i] = req.token_slice(pos, pos + 1)[0]
            positions[i] = pos
            slots[i] = blocks[n - 1] * bs + pos % bs
            ctx_lens[i] = pos + 1
            keep[i] = not req.params.argmax_only
            _write_row(tables, rows, i, blocks, n, static.pad)
        _clear_rows(tables, rows, batch, static.pad)
        static.buffer.copy_(host, non_blocking=True)
        if static.flashinfer is not None:
            static.flashinfer.plan(tables, ctx_lens)
        if fed is not None:  # input ids still on the device (async scheduling): rows align
            static.buffer[:batch].copy_(fed)
        static.graph.replay()
        self._last = static
        return static.logits[:batch], static.greedy[:batch]

    def draw(self, chunks, picked: list[int], row_seed) -> torch.Tensor | None:
        """The sampled tokens of chunks `picked` of the step just launched, drawn by a captured
        sampler graph over its logits (engine/sampler_graphs.py); None: draw them eagerly."""
        static = self._last
        if static is None or not self.sampler_graphs:
            return None
        if static.sampler is None:
            static.sampler = SamplerGraphs(static.logits)
        return static.sampler.draw(chunks, picked, row_seed)

    def reset(self) -> None:
        """Drop every graph (their KV pointers are about to change); re-captured on use."""
        self._static.clear()
        self._pool = None
        self._last = None
        self._fi_workspace = None
        if self.mixed is not None:
            self.mixed.reset()

    def _get(self, bucket: int, width: int) -> _Static:
        static = self._static.get((bucket, width))
        if static is None:
            static = self._static[bucket, width] = self._capture(bucket, width)
        return static

    def _padding(self, bucket: int, width: int) -> torch.Tensor:
        """An all-padding batch: rows point at the scratch block (position 0, context 1)."""
        buf = torch.zeros(bucket * (_ROW_FIELDS + width), dtype=torch.long)
        ids, positions, slots, ctx_lens, _, tables = _fields(buf, bucket)  # keep 0: padding's logits go unread
        slots.fill_(self.scratch_block * self.block_size)
        ctx_lens.fill_(1)
        tables.fill_(self.scratch_block)
        return buf

    @torch.inference_mode()
    def _capture(self, bucket: int, width: int) -> _Static:
        device = self.kv_caches[0].device
        template = self._padding(bucket, width)
        hosts = (template.pin_memory(), template.pin_memory())  # pinned copies: every row padding
        static = _Static(template.to(device), hosts, template, pad=_fields(template, bucket)[5].numpy(),
                         rows=([None] * bucket, [None] * bucket))
        ids, positions, slots, ctx_lens, keep, tables = _fields(static.buffer, bucket)
        keep_rows = keep if SKIP_UNREAD_LOGITS else None
        planned = None
        if self.flashinfer is not None:
            from splitserve.engine import attention_flashinfer

            if self._fi_workspace is None:
                self._fi_workspace = attention_flashinfer.workspace(device)
            static.flashinfer = attention_flashinfer.GraphDecode(device, self.flashinfer, bucket, width,
                                                                 self._fi_workspace)
            _, _, _, host_lens, _, host_tables = _fields(template, bucket)
            static.flashinfer.plan(host_tables.numpy(), host_lens.numpy())
            planned = static.flashinfer.planned
        meta = AttentionMetadata(
            slot_mapping=slots,
            backend="triton" if planned is None else "flashinfer",
            is_decode_only=True,
            block_tables=tables,
            ctx_lens=ctx_lens,
            planned=planned,
        )

        def forward() -> tuple[torch.Tensor, torch.Tensor]:
            hidden = self.model(positions, meta, self.kv_caches, input_ids=ids)
            # greedy: from the LM head's epilogue; rows with keep 0 get no logits stored
            logits, greedy = self.model.logits_and_argmax(hidden, keep_rows)
            # else a pass of our own: torch gives a row to one SM, slow for 128k vocabularies
            return logits, greedy if greedy is not None else kernels.argmax_rows(logits)

        static.graph, (static.logits, static.greedy) = capture(forward, self._pool)
        self._pool = static.graph.pool()
        return static


def capture(forward, pool=None):
    """(graph, outputs) of `forward()` captured into memory pool `pool` (None: a new one), after two
    warm-up calls on a side stream, which compile the kernels outside the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = forward()
    return graph, outputs
