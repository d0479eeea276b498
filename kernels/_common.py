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
