"""The batched device sampler replayed from CUDA graphs, over a decode graph's logits buffer.

A sampled decode step queues ~6 sampler launches (two parameter copies, `topk`, the threshold
and draw kernels, the merge) behind the decode graph; on the H200 host their Python and launch
cost (~0.3 ms a step) is what a sampled step still paid over a greedy one once it ran ahead
(benchmarks/RESULTS.md, 2026-12-02 session 7). Here they are captured once per

    (rows bucket, top-k bucket, top-p on/off)

on the decode bucket's own logits buffer (so a graph lives and dies with that buffer:
`DecodeGraphs` holds these per bucket and drops them with its graphs), and a step writes its
rows' parameters into a pinned buffer, copies them up in two non-blocking copies and replays.

The draw is the same as `kernels.sample_rows` with the flags given: top-k thresholds come from
the top `k bucket` values (>= every row's k, so the k-th value and the top-p mass over the first
k are unchanged), rows past the step's picked ones are padding (row 0, temperature 1, no masks)
whose tokens are never read. Not graphed (the caller draws eagerly): a top-p row without a
top-k (a full sort), or a top-k above `MAX_TOP_K`.

The pinned parameter buffers alternate between two copies: the engine waits for step N's
tokens before it launches step N + 2, so the copy that read a buffer has run before that buffer
is written again even while step N + 1 is still in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from splitserve.engine.device_sampler import mask_flags
from splitserve.kernels._common import next_power_of_2

MAX_TOP_K = 1024
"""Largest top-k the graphs draw (a `topk` of this many values per row); above it: eager."""


@dataclass
class _Draw:
    graph: torch.cuda.CUDAGraph
    ints: torch.Tensor
    """int64 [rows, 3]: (logits row, top-k, seed) on the device."""
    floats: torch.Tensor
    """float32 [rows, 2]: (temperature, top-p) on the device."""
    hosts: list[tuple[torch.Tensor, torch.Tensor]]
    """Two pinned (ints, floats) twins, used in turn."""
    out: torch.Tensor
    turn: int = 0


@dataclass
class SamplerGraphs:
    """Captured draws over one logits buffer `[bucket, vocab]` (a decode graph's output)."""

    logits: torch.Tensor
    _draws: dict[tuple[int, int, bool], _Draw] = field(default_factory=dict)

    @torch.inference_mode()  # the buffers are made under it (`_capture`), as the engine's steps run
    def draw(self, chunks, picked: Sequence[int], row_seed: Callable[[object], int]) -> torch.Tensor | None:
        """Tokens [len(picked)] on the device for chunks `picked` (row i of the logits = chunk
        i), queued on the current stream; None when this draw is not graphed."""
        params = [chunks[i].request.params for i in picked]
        max_k, use_p, within = mask_flags(params, self.logits.shape[1])
        if not within or max_k > MAX_TOP_K:  # a top-p row without a top-k needs a full sort
            return None
        k_bucket = next_power_of_2(max(max_k, 16)) if max_k else 0
        n = len(picked)
        rows = min(next_power_of_2(n), self.logits.shape[0])  # n never exceeds the logits' rows
        key = (rows, k_bucket, use_p)
        draw = self._draws.get(key)
        if draw is None:
            draw = self._draws[key] = self._capture(*key)
        ints, floats = draw.hosts[draw.turn]
        draw.turn ^= 1
        ints.zero_()
        floats[:, 0] = 1.0
        floats[:, 1] = 0.0
        iv, fv = ints.numpy(), floats.numpy()
        for j, (i, p) in enumerate(zip(picked, params, strict=True)):
            iv[j, 0], iv[j, 1], iv[j, 2] = i, p.top_k, row_seed(chunks[i].request)
            fv[j, 0], fv[j, 1] = p.temperature, p.top_p
        draw.ints.copy_(ints, non_blocking=True)
        draw.floats.copy_(floats, non_blocking=True)
        draw.graph.replay()
        return draw.out[:n]

    @torch.inference_mode()
    def _capture(self, rows: int, k_bucket: int, use_p: bool) -> _Draw:
        from splitserve import kernels

        device = self.logits.device
        ints = torch.zeros(rows, 3, dtype=torch.long, device=device)
        floats = torch.ones(rows, 2, dtype=torch.float32, device=device)
        hosts = [(torch.zeros(rows, 3, dtype=torch.long).pin_memory(), torch.zeros(rows, 2).pin_memory())
                 for _ in range(2)]

        def run() -> torch.Tensor:
            return kernels.sample_rows(self.logits, floats[:, 0], ints[:, 1], floats[:, 1], ints[:, 2], rows=ints[:, 0],
                                       max_top_k=k_bucket, any_top_p=use_p, top_p_within_top_k=True)

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # compiles the kernels outside the capture
            run()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # other threads' CUDA work goes on
            out = run()
        return _Draw(graph, ints, floats, hosts, out)
