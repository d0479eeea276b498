"""A captured one-kernel CUDA graph whose int32 scalar arguments are rewritten per launch through
the CUDA driver (`cuGraphExecKernelNodeSetParams`), instead of reading them from a device table
that a pinned-to-device memcpy node fills first.

Why: a handoff copy between two fixed pools is one kernel launch whose only changing inputs are
three ints (source block, destination block, run length). Passing them through a memcpy node
cost ~4 µs per pull on the H200 (host: 5.3 µs to launch the two-node graph against 2.6 µs for one
kernel node through the driver; device: a copy-engine step before the kernel) — a tenth of a
1k-token handoff (~28 µs). Rewriting the node's arguments costs ~1 µs of host time and nothing
on the device (benchmarks/RESULTS.md, 2026-12-04 session 19).

How the arguments are found: the kernel is captured with distinctive sentinel values in the
rewritable slots; the node's argument list (sizes from `cuFuncGetParamInfo`) is copied into
buffers this object owns, and each sentinel must appear in exactly one 4-byte slot. Anything
unexpected (no driver library, an old driver without the entry points, a node that is not one
kernel, a sentinel found twice or not at all, a grid or block other than launched) raises
`Unsupported`, and the caller uses its memcpy-node graph instead. Updating an executable graph
does not affect launches already queued (CUDA's documented semantics), so a new launch may be
prepared while the previous one still runs; set-and-launch pairs are serialised by the caller.

`SPLITSERVE_GRAPH_PARAMS=0` turns this off (A/B runs, or a driver that misbehaves).
"""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Callable, Sequence

import torch


class Unsupported(RuntimeError):
    """This process cannot rewrite graph kernel arguments; use another graph."""


class _KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2, with room to spare for fields a newer driver appends."""

    _fields_ = [
        ("func", ctypes.c_void_p),
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem", ctypes.c_uint),
        ("kernel_params", ctypes.c_void_p),
        ("extra", ctypes.c_void_p),
        ("kern", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
        ("_spare", ctypes.c_char * 64),
    ]


_DRIVER: list = []


def driver():
    """libcuda through ctypes with the entry points used here, or None (not loadable, too old, or
    turned off by SPLITSERVE_GRAPH_PARAMS=0)."""
    if not _DRIVER:
        lib = None
        if os.environ.get("SPLITSERVE_GRAPH_PARAMS", "1") != "0":
            try:
                lib = ctypes.CDLL("libcuda.so.1")
                vp, sz = ctypes.c_void_p, ctypes.c_size_t
                for name, args in (
                    ("cuGraphGetNodes", (vp, vp, vp)),
                    ("cuGraphNodeGetType", (vp, vp)),
                    ("cuGraphKernelNodeGetParams_v2", (vp, vp)),
                    ("cuFuncGetParamInfo", (vp, sz, vp, vp)),
                    ("cuGraphExecKernelNodeSetParams_v2", (vp, vp, vp)),
                    ("cuGraphLaunch", (vp, vp)),
                    ("cuStreamSynchronize", (vp,)),
                ):
                    fn = getattr(lib, name)
                    fn.argtypes, fn.restype = args, ctypes.c_int
            except (OSError, AttributeError):
                lib = None
        _DRIVER.append(lib)
    return _DRIVER[0]


def find_slots(params: Sequence[bytes], sentinels: Sequence[int]) -> list[int]:
    """Index of the one 4-byte argument holding each sentinel (native int32); `Unsupported` when a
    sentinel is in no slot or in several (then the slot cannot be told apart)."""
    slots = []
    for value in sentinels:
        packed = struct.pack("=i", value)
        found = [i for i, p in enumerate(params) if len(p) == 4 and bytes(p) == packed]
        if len(found) != 1:
            raise Unsupported(f"sentinel {value} found in {len(found)} kernel arguments, need exactly one")
        slots.append(found[0])
    return slots


def _check(result: int, what: str) -> None:
    if result != 0:
        raise Unsupported(f"{what} failed (CUresult {result})")


def capture_graph(fn: Callable[[], None], device, keep_graph: bool = False) -> torch.cuda.CUDAGraph:
    """`fn`'s CUDA work captured on a side stream of `device`, ordered after the current stream's
    work; thread-local capture, so other threads' CUDA work (an engine loop) goes on meanwhile."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph(keep_graph=keep_graph)
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph


class ScalarGraph:
    """A graph of one kernel launch, captured by `capture(*sentinels)` on the current device, whose
    int32 arguments that held the sentinels are set by `launch(values, stream)`."""

    def __init__(self, capture: Callable[..., None], sentinels: Sequence[int], grid: Sequence[int],
                 num_warps: int) -> None:
        lib = driver()
        if lib is None:
            raise Unsupported("the CUDA driver library cannot be used from ctypes here")
        self.device = torch.cuda.current_device()
        self.graph = capture_graph(lambda: capture(*sentinels), self.device, keep_graph=True)
        self.graph.instantiate()
        raw = ctypes.c_void_p(self.graph.raw_cuda_graph())
        count = ctypes.c_size_t(0)
        _check(lib.cuGraphGetNodes(raw, None, ctypes.byref(count)), "cuGraphGetNodes")
        if count.value != 1:
            raise Unsupported(f"the captured graph has {count.value} nodes, not one kernel")
        nodes = (ctypes.c_void_p * 1)()
        _check(lib.cuGraphGetNodes(raw, nodes, ctypes.byref(count)), "cuGraphGetNodes")
        self._node = ctypes.c_void_p(nodes[0])
        kind = ctypes.c_int(-1)
        _check(lib.cuGraphNodeGetType(self._node, ctypes.byref(kind)), "cuGraphNodeGetType")
        params = _KernelNodeParams()
        _check(lib.cuGraphKernelNodeGetParams_v2(self._node, ctypes.byref(params)), "cuGraphKernelNodeGetParams")
        if kind.value != 0 or not params.func or params.extra or not params.kernel_params:
            raise Unsupported("the captured node is not a kernel launched with an argument list")
        padded = tuple(grid) + (1,) * (3 - len(grid))
        if tuple(params.grid) != padded or tuple(params.block) != (32 * num_warps, 1, 1):
            raise Unsupported(f"node grid {tuple(params.grid)} block {tuple(params.block)}, launched {padded} x "
                              f"{32 * num_warps}")
        sizes = []
        while True:  # the kernel's argument sizes, until the index runs past the last one
            offset, size = ctypes.c_size_t(), ctypes.c_size_t()
            if lib.cuFuncGetParamInfo(ctypes.c_void_p(params.func), len(sizes), ctypes.byref(offset),
                                      ctypes.byref(size)) != 0:
                break
            sizes.append(size.value)
        if not sizes:
            raise Unsupported("cuFuncGetParamInfo gave no arguments")
        old = ctypes.cast(params.kernel_params, ctypes.POINTER(ctypes.c_void_p))
        self._buffers = []
        for i, size in enumerate(sizes):
            buf = (ctypes.c_char * size)()
            ctypes.memmove(buf, old[i], size)
            self._buffers.append(buf)
        slots = find_slots([bytes(b) for b in self._buffers], sentinels)
        self._slots = [ctypes.c_int32.from_buffer(self._buffers[i]) for i in slots]
        self._pointers = (ctypes.c_void_p * len(sizes))(*map(ctypes.addressof, self._buffers))
        params.kernel_params = ctypes.cast(self._pointers, ctypes.c_void_p)
        self._params = params  # the driver reads the argument list through these on every set
        self._params_ref = ctypes.byref(params)
        self._exec = ctypes.c_void_p(self.graph.raw_cuda_graph_exec())
        self._set = lib.cuGraphExecKernelNodeSetParams_v2
        self._launch = lib.cuGraphLaunch

    def launch(self, values: Sequence[int], stream: torch.cuda.Stream) -> None:
        """Set the arguments to `values` (int32, in sentinel order) and launch on `stream`. The
        caller serialises launches of one graph (the arguments are one set of buffers)."""
        for slot, value in zip(self._slots, values, strict=True):
            slot.value = value
        handle = stream.cuda_stream
        if self._set(self._exec, self._node, self._params_ref) or self._launch(self._exec, handle):
            # e.g. no current CUDA context in this thread yet, or another device's: once more
            # with the graph's device made current by torch, then give up loudly
            with torch.cuda.device(self.device):
                _check(self._set(self._exec, self._node, self._params_ref), "cuGraphExecKernelNodeSetParams")
                _check(self._launch(self._exec, handle), "cuGraphLaunch")


def synchronize(stream: torch.cuda.Stream) -> None:
    """`stream.synchronize()` through the driver (~0.4 µs less on the H200 host); any error is left
    to torch's own call, which raises it as torch does."""
    lib = _DRIVER[0] if _DRIVER else driver()
    if lib is None or lib.cuStreamSynchronize(stream.cuda_stream) != 0:
        stream.synchronize()
