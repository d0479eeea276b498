"""Launch helpers shared by the kernels: argument checks and device facts.

Everything here depends on shapes, dtypes and the device only, never on tensor
values, so the launches stay CUDA-graph capturable.
"""

from __future__ import annotations

import functools
import math

import torch

LOG2_E = math.log2(math.e)

# Multiprocessor count used when there is no CUDA device (Triton interpreter on CPU):
# small, so the heuristics pick few programs and the interpreter stays quick.
_CPU_NUM_SMS = 4


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _cuda_num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _CPU_NUM_SMS
    return _cuda_num_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cuda_major(device: torch.device) -> int:
    """The compute capability's major version of a CUDA device (9 = Hopper), 0 off CUDA."""
    if device.type != "cuda":
        return 0
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())[0]


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs must not be rounded to tf32 (the fp32 engine path is a parity
    reference); fp16/bf16 ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_kv(kv: torch.Tensor, head_dim: int) -> None:
    if kv.dim() != 5 or kv.shape[0] != 2:
        raise ValueError(
            f"kv must be [2, num_blocks, num_kv_heads, block_size, head_dim], got {tuple(kv.shape)}"
        )
    if kv.shape[4] != head_dim:
        raise ValueError(f"kv head_dim {kv.shape[4]} != {head_dim}")
    if kv.stride(4) != 1:
        raise ValueError(f"kv must be contiguous in head_dim, got strides {kv.stride()}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


_LAYER_OFFSETS: dict[tuple, torch.Tensor] = {}
_MAX_CACHED_OFFSETS = 64


def layer_offsets(tensors, device: torch.device, align: int = 16) -> torch.Tensor:
    """int64 element offsets of each layer's tensor from the first one's (one address space),
    on `device`, so that one launch can serve every layer of a KV pool. Every layer must have
    the first one's shape, strides, dtype and device (ValueError otherwise).

    Cached by the tensors' addresses and the first one's shape and strides: a pool's layers (and
    a peer's mapped pool) never move, so a handoff reuses one small device tensor and one check
    instead of paying a host-to-device copy and ~50 µs of Python per launch (measured on the H200
    at 8k tokens, where the whole copy takes ~140 µs). Offsets must be multiples of `align`
    elements (keeps the kernels' loads vectorised)."""
    first = tensors[0]
    key = (str(device), first.dtype, tuple(first.shape), first.stride(), align, *(t.data_ptr() for t in tensors))
    cached = _LAYER_OFFSETS.get(key)
    if cached is not None:
        return cached
    for t in tensors[1:]:
        if t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype or t.device != first.device:
            raise ValueError("every layer must have the first one's shape, strides, dtype and device")
    base, size = first.data_ptr(), first.element_size()
    deltas = [t.data_ptr() - base for t in tensors]
    if any(d % (align * size) for d in deltas):
        raise ValueError(f"layer tensors are not {align}-element aligned to each other")
    offsets = torch.tensor([d // size for d in deltas], dtype=torch.int64).to(device)
    if len(_LAYER_OFFSETS) >= _MAX_CACHED_OFFSETS:
        _LAYER_OFFSETS.clear()
    _LAYER_OFFSETS[key] = offsets
    return offsets
