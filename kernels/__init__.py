"""splitserve.kernels: Triton kernels for paged attention, KV writes and the Mamba2 (SSD) scan.

Every kernel has a plain-torch reference in `reference.py` and a test comparing
the two (tests/kernels/). Importing this package does not import triton (nor
torch): the kernel modules load on first attribute access, so the engine can
ask `triton_available()` first and fall back to its torch path.

    from splitserve import kernels
    if kernels.triton_available() and q.is_cuda:
        out = kernels.paged_decode_attention(q, kv, block_tables, ctx_lens, scale)
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from typing import TYPE_CHECKING, Any

__all__ = [
    "DecodePlan",
    "DecodeWorkspace",
    "apply_rotary_qk",
    "apply_rotary_qk_and_write_kv",
    "add_residual",
    "adjust_logit_rows",
    "argmax_rows",
    "causal_conv1d",
    "causal_conv1d_update",
    "RowNorm",
    "decode_linear",
    "decode_linear_add",
    "decode_linear_glu",
    "decode_linear_partials",
    "decode_attention_unsplit",
    "decode_qkv_rotary",
    "embed_rms_norm",
    "kv_block_checksums",
    "paged_decode_attention",
    "paged_prefill_attention",
    "plan_decode",
    "rms_norm",
    "row_logprobs",
    "sample_rows",
    "selective_state_update",
    "silu_and_mul",
    "ssd_chunk_scan",
    "triton_available",
    "write_kv",
]

_LAZY = {
    "DecodePlan": "decode_plan",
    "DecodeWorkspace": "decode_plan",
    "plan_decode": "decode_plan",
    "paged_decode_attention": "paged_decode",
    "decode_attention_unsplit": "paged_decode",
    "paged_prefill_attention": "paged_prefill",
    "write_kv": "kv_write",
    "rms_norm": "norm",
    "add_residual": "norm",
    "embed_rms_norm": "norm",
    "apply_rotary_qk": "rotary",
    "apply_rotary_qk_and_write_kv": "rotary",
    "adjust_logit_rows": "logit_adjust",
    "row_logprobs": "logprobs",
    "argmax_rows": "argmax",
    "causal_conv1d": "conv1d",
    "causal_conv1d_update": "conv1d",
    "kv_block_checksums": "kv_checksum",
    "RowNorm": "linear",
    "decode_linear": "linear",
    "decode_linear_add": "linear",
    "decode_linear_glu": "linear",
    "decode_linear_partials": "linear",
    "decode_qkv_rotary": "qkv_rotary",
    "sample_rows": "sampling",
    "silu_and_mul": "activation",
    "selective_state_update": "ssm_state_update",
    "ssd_chunk_scan": "ssd_scan",
}

if TYPE_CHECKING:  # pragma: no cover
    from .activation import silu_and_mul
    from .argmax import argmax_rows
    from .conv1d import causal_conv1d, causal_conv1d_update
    from .decode_plan import DecodePlan, DecodeWorkspace, plan_decode
    from .kv_checksum import kv_block_checksums
    from .kv_write import write_kv
    from .linear import RowNorm, decode_linear, decode_linear_add, decode_linear_glu, decode_linear_partials
    from .logit_adjust import adjust_logit_rows
    from .logprobs import row_logprobs
    from .norm import add_residual, embed_rms_norm, rms_norm
    from .paged_decode import decode_attention_unsplit, paged_decode_attention
    from .paged_prefill import paged_prefill_attention
    from .qkv_rotary import decode_qkv_rotary
    from .rotary import apply_rotary_qk, apply_rotary_qk_and_write_kv
    from .sampling import sample_rows
    from .ssd_scan import ssd_chunk_scan
    from .ssm_state_update import selective_state_update


def triton_available() -> bool:
    """True when the Triton kernels can run here: triton imports, and there is a
    CUDA device or the Triton interpreter is on (`TRITON_INTERPRET=1`, CPU tests).

    The interpreter is slow: callers on CPU should still prefer the torch path
    unless they are testing the kernels.
    """
    if not _triton_importable():
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    import torch

    return torch.cuda.is_available()


@functools.cache
def _triton_importable() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        importlib.import_module("triton")
    except Exception:  # a broken install (e.g. no matching driver libs) counts as absent
        return False
    return True


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'splitserve.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
