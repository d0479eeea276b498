"""CUDA graphs for decode-only steps (the Triton attention backend).

One graph per batch-size bucket (1, 2, 4, …, max), captured lazily the first
time a step of that size runs. Each graph owns static inputs and replays

    embed -> layers (write_kv + paged decode attention) -> norm -> lm_head -> logits [bucket, vocab]

A batch of B < bucket sequences is padded: the extra rows point at the scratch
block (position 0, context length 1), so they write and read only memory no
request owns. Graphs bake in the KV tensors' addresses: a lifecycle suspend
(which frees that memory) calls `reset`, and they are captured again on use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.attention import AttentionMetadata
from splitserve.engine.batch import StepInputs


@dataclass
class _Static:
    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    tables: torch.Tensor
    ctx_lens: torch.Tensor
    logits: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None


def buckets_up_to(max_batch: int) -> list[int]:
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return [*sizes, max_batch]


class DecodeGraphs:
    def __init__(self, model, kv_caches, *, max_batch: int, max_blocks: int, scratch_block: int, block_size: int):
        self.model = model
        self.kv_caches = kv_caches
        self.buckets = buckets_up_to(max_batch)
        self.max_blocks = max_blocks
        self.scratch_block = scratch_block
        self.block_size = block_size
        self._static: dict[int, _Static] = {}
        self._pool = None

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def can_run(self, inputs: StepInputs) -> bool:
        meta = inputs.meta
        return (
            meta.is_decode_only
            and meta.block_tables.shape[0] <= self.max_batch
            and meta.block_tables.shape[1] <= self.max_blocks
        )

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [B, vocab] float32 for a decode-only batch of B sequences."""
        meta = inputs.meta
        batch, width = meta.block_tables.shape
        static = self._get(next(b for b in self.buckets if b >= batch))
        static.ids[:batch].copy_(inputs.input_ids)
        static.positions[:batch].copy_(inputs.positions)
        static.slots[:batch].copy_(meta.slot_mapping)
        static.ctx_lens[:batch].copy_(meta.ctx_lens)
        static.tables[:batch, :width].copy_(meta.block_tables)
        static.tables[:batch, width:].fill_(self.scratch_block)
        self._pad(static, batch)
        static.graph.replay()
        return static.logits[:batch]

    def reset(self) -> None:
        """Drop every graph (their KV pointers are about to change); re-captured on use."""
        self._static.clear()
        self._pool = None

    def _pad(self, static: _Static, start: int) -> None:
        static.ids[start:].zero_()
        static.positions[start:].zero_()
        static.slots[start:].fill_(self.scratch_block * self.block_size)
        static.ctx_lens[start:].fill_(1)
        static.tables[start:].fill_(self.scratch_block)

    def _get(self, bucket: int) -> _Static:
        static = self._static.get(bucket)
        if static is None:
            static = self._static[bucket] = self._capture(bucket)
        return static

    @torch.inference_mode()
    def _capture(self, bucket: int) -> _Static:
        device = self.kv_caches[0].device

        def zeros(*shape):
            return torch.zeros(*shape, dtype=torch.long, device=device)

        static = _Static(zeros(bucket), zeros(bucket), zeros(bucket), zeros(bucket, self.max_blocks), zeros(bucket))
        self._pad(static, 0)
        meta = AttentionMetadata(
            slot_mapping=static.slots,
            backend="triton",
            is_decode_only=True,
            block_tables=static.tables,
            ctx_lens=static.ctx_lens,
        )

        def forward() -> torch.Tensor:
            hidden = self.model(static.positions, meta, self.kv_caches, input_ids=static.ids)
            return self.model.compute_logits(hidden)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compiles the kernels outside the capture
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            static.logits = forward()
        self._pool = graph.pool()
        static.graph = graph
        return static
