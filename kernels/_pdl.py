"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

A batch-64 decode step of a 1B model is ~170 kernels in one CUDA graph, most of them a few
microseconds long, and a graph still serialises them: a kernel's blocks are launched only
after the previous kernel has fully drained. Launched with PDL, a kernel's grid is set up
while the previous one drains, and its programs wait at `griddepcontrol.wait` (Triton's
`gdc_wait`) until the previous kernel's writes are visible — so every kernel here calls
`wait_for_producer` before its first load of anything a previous kernel may have written.

`SPLITSERVE_PDL`: `0` off; `1` launch with PDL and wait; `2` (default) also signal dependents
right after the wait (`gdc_launch_dependents`), so the next PDL kernel's programs may occupy
free multiprocessors early. Off without a CUDA device of compute capability 9.0+, and in
Triton's interpreter (the CPU tests), where the constexpr switch compiles the wait away, and on ROCm.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._common import cuda_major

try:  # Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL stays off
    gdc_wait = gdc_launch_dependents = None


def _capable(device: torch.device) -> bool:
    """An NVIDIA GPU of compute capability 9.0+ (ROCm reports its gfx version as the capability:
    MI300 would read 9.4, and AMD has no griddepcontrol)."""
    return gdc_wait is not None and torch.version.hip is None and cuda_major(device) >= 9


def pdl_mode(device: torch.device) -> int:
    """0, 1 or 2 (see the module docstring) for launches on `device`."""
    setting = os.environ.get("SPLITSERVE_PDL", "2")
    if setting not in ("0", "1", "2"):
        raise ValueError(f"SPLITSERVE_PDL must be 0 (off), 1 (wait) or 2 (wait and signal early), got {setting!r}")
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") in ("1", "true"):
        return 0
    mode = int(setting)
    return mode if mode and _capable(device) else 0


def pdl_launch(device: torch.device, signal_early: bool = True) -> dict:
    """Keyword arguments for `kernel[grid](...)`: the kernel's `PDL` constexpr, and Triton's
    `launch_pdl` flag when it is on (left out otherwise, for Triton's interpreter).
    `signal_early=False`: mode 2 taken as 1 for this kernel — its dependents' programs are
    launched as its own exit, not while it runs (for a dependent whose early programs would
    hold multiprocessors and wait, e.g. the unsplit decode attention: paged_decode.py)."""
    mode = pdl_mode(device)
    if not signal_early:
        mode = min(mode, 1)
    return {"PDL": mode, "launch_pdl": True} if mode else {"PDL": 0}


@triton.jit
def wait_for_producer(PDL: tl.constexpr):
    if PDL > 0:
        gdc_wait()
    if PDL > 1:
        gdc_launch_dependents()
