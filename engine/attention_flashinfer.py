"""FlashInfer paged attention (CUDA, when the `flashinfer` package is installed).

Reads the engine's KV layout as it is: one layer's `kv[2, blocks, kv_heads, block_size, head_dim]`
is FlashInfer's "HND" paged cache given as the tuple `(kv[0], kv[1])`, so no copy and no second
cache format. Rotary and the KV write stay our fused Triton kernel (models/fused.py); only the
attention itself is FlashInfer's:

    decode-only step   BatchDecodeWithPagedKVCacheWrapper (split-KV flash decoding)
    any other step     BatchPrefillWithPagedKVCacheWrapper (ragged queries over a paged prefix,
                       causal: query row r of a chunk sees the prefix and chunk rows <= r)

A wrapper is *planned* once per step from host-side tables (FlashInfer schedules the work on
the CPU) and *run* in every layer. Planning writes a pinned host buffer and queues its copy to
the device; with async scheduling step N + 1 is planned while step N may still be queued, so
planners alternate (`FlashInferPlanner` keeps two), the same reason the decode graphs keep two
pinned input twins (engine/cuda_graphs.py).

CUDA graphs (`GraphDecode`): one wrapper per captured (batch bucket, context bucket) with fixed
index buffers; it is planned before capture and again before every replay, so the captured
kernels read the new step's pages.

Why not the default: on the H200 (FlashInfer 0.6.6) our Triton decode kernel was faster at the
Llama-3.2-1B shape — 28.9 against 37.6 µs a layer at batch 64 × 768 tokens, 6.1 against 8.2 at
batch 1 (benchmarks/kernels.py) — and the engine decoded at 52–57% of the HBM roofline on Triton
against 49–50% on FlashInfer in the same call (benchmarks/engine.py, RESULTS.md 2026-12-02 session
8). FlashInfer builds each kernel variant with nvcc on first use (needs the CUDA toolkit) and
cannot run on CPU or under the Triton interpreter, where our tests run. Its prefill kernel was
15–20% faster than ours at 8k-token prompts. `attention_backend="flashinfer"` selects it; "auto"
stays Triton.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import torch

WORKSPACE_BYTES = 128 << 20
"""FlashInfer's float workspace (split-KV partial outputs); its documentation's recommended size."""


def workspace(device: torch.device) -> torch.Tensor:
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def available() -> bool:
    """FlashInfer importable and a CUDA device present."""
    return torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


def require() -> None:
    """A clear error where `attention_backend="flashinfer"` cannot run."""
    if not torch.cuda.is_available():
        raise ValueError("attention_backend=flashinfer needs a CUDA device")
    if importlib.util.find_spec("flashinfer") is None:
        raise ValueError("attention_backend=flashinfer needs the flashinfer package (pip install flashinfer-python)")


def paged_indices(
    tables: np.ndarray, ctx_lens: np.ndarray, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indptr [S + 1], indices [sum of pages], last_page_len [S]) int32 host tensors: FlashInfer's
    CSR form of padded block tables [S, width], each row cut to the blocks its context uses."""
    tables, ctx_lens = np.asarray(tables), np.asarray(ctx_lens, dtype=np.int64)
    pages = (ctx_lens + block_size - 1) // block_size
    indptr = np.zeros(len(pages) + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    used = np.arange(tables.shape[1])[None, :] < pages[:, None]
    indices = tables[used].astype(np.int32)
    last = (ctx_lens - (pages - 1) * block_size).astype(np.int32)
    return torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last)


class _Planned:
    """One step's planned wrapper; `run(q, kv)` per layer."""

    def __init__(self, wrapper):
        self.wrapper = wrapper

    def run(self, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.wrapper.run(q, (kv[0], kv[1]), out=out)


class Shape:
    """What FlashInfer plans for: one rank's attention heads, KV blocks and dtype, the softmax scale."""

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 scale: float, tensor_cores: bool = True):
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.block_size, self.dtype, self.scale = block_size, dtype, scale
        self.tensor_cores = tensor_cores
        """Decode through FlashInfer's prefill kernels (tensor cores): its advice for GQA groups >= 4."""

    def plan_decode(self, wrapper, indptr, indices, last) -> None:
        wrapper.plan(
            indptr, indices, last, self.num_q_heads, self.num_kv_heads, self.head_dim, self.block_size,
            q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale,
        )


class _Planner:
    def __init__(self, device: torch.device, shape: Shape):
        import flashinfer

        self.shape = shape
        floats = workspace(device)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            floats, kv_layout="HND", use_tensor_cores=shape.tensor_cores
        )
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(floats, kv_layout="HND")

    def plan(self, tables, ctx_lens, q_starts, decode_only: bool) -> _Planned:
        shape = self.shape
        indptr, indices, last = paged_indices(tables, ctx_lens, shape.block_size)
        if decode_only:
            shape.plan_decode(self.decode, indptr, indices, last)
            return _Planned(self.decode)
        self.prefill.plan(
            torch.tensor(q_starts, dtype=torch.int32), indptr, indices, last,
            shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.block_size,
            causal=True, sm_scale=shape.scale, q_data_type=shape.dtype, kv_data_type=shape.dtype,
        )
        return _Planned(self.prefill)


class FlashInferPlanner:
    """An engine's FlashInfer wrappers: `plan(...)` once per eager step, alternating between two
    planners (see the module docstring)."""

    def __init__(self, device: torch.device, shape: Shape):
        require()
        self._planners = (_Planner(device, shape), _Planner(device, shape))
        self._turn = 0

    def plan(self, tables, ctx_lens, q_starts: list[int], decode_only: bool) -> _Planned:
        """Plan a step: padded block tables [S, width] and context lengths [S] (lists or arrays),
        the sequences' query offsets in the flat batch [S + 1]."""
        planner = self._planners[self._turn]
        self._turn ^= 1
        return planner.plan(tables, ctx_lens, q_starts, decode_only)


class GraphDecode:
    """A CUDA-graph decode wrapper for one captured bucket: fixed index buffers of `batch` rows ×
    `width` pages. `plan(tables, ctx_lens)` before capture and before each replay (host work
    only, plus copies queued on the current stream)."""

    def __init__(self, device: torch.device, shape: Shape, batch: int, width: int, workspace: torch.Tensor):
        """`workspace`: the float workspace, shared by every graph of an engine (one replays at a
        time, in stream order; each is planned again before it replays)."""
        import flashinfer

        self.shape = shape
        self._copied: torch.cuda.Event | None = None
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, kv_layout="HND", use_cuda_graph=True, use_tensor_cores=shape.tensor_cores,
            paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device=device),
            paged_kv_indices_buffer=torch.zeros(batch * width, dtype=torch.int32, device=device),
            paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device=device),
        )
        self.planned = _Planned(self.wrapper)
        self._pinned = tuple(
            torch.zeros(n, dtype=torch.int32).pin_memory() for n in (batch + 1, batch * width, batch)
        )
        self._indices = torch.zeros(batch * width, dtype=torch.int32, device=device)
        """The page ids go up by our own non-blocking copy: FlashInfer copies host `indices` blocking
        (a host-to-device copy that waits for the stream), which would hold the host until the step
        in flight finished and end async scheduling's run-ahead."""

    def plan(self, tables, ctx_lens) -> None:
        """Plan one step. The pinned sources and the wrapper's pinned staging buffer are reused
        each step: first wait until the previous plan's copies have left them (they were queued
        ahead of the previous replay, so this rarely waits)."""
        if self._copied is not None:
            self._copied.synchronize()
        indptr, indices, last = paged_indices(tables, ctx_lens, self.shape.block_size)
        pins, n = self._pinned, len(indices)
        pins[0].copy_(indptr)
        pins[1][:n].copy_(indices)
        pins[2].copy_(last)
        self._indices[:n].copy_(pins[1][:n], non_blocking=True)
        self.shape.plan_decode(self.wrapper, pins[0], self._indices[:n], pins[2])
        self._copied = torch.cuda.Event()
        self._copied.record()
