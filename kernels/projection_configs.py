"""Which decoder-layer projections run our decode kernel (`kernels.linear`) and under which
tile config: a table measured on an H200, per projection kind and row count."""

from __future__ import annotations

import torch

from ._common import cuda_major
from ._pdl import pdl_mode
from .linear import MAX_ROWS, LinearConfig

__all__ = ["PROJECTION_CONFIGS", "projection_config"]

PROJECTION_CONFIGS = {
    # kind: (config for <= 16 rows, config for 17..64 rows; None = cuBLAS)
    "qkv": (LinearConfig(32, 512, 2, 4), LinearConfig(32, 256, 4, 4)),
    "o": (LinearConfig(16, 512, 2, 4), LinearConfig(16, 256, 4, 4)),
    "gate_up": (LinearConfig(32, 128, 2, 3), LinearConfig(64, 128, 4, 3)),
    "down": (LinearConfig(16, 512, 2, 5), LinearConfig(64, 128, 4, 4, splits=4)),
}


def projection_config(
    kind: str, rows: int, device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> LinearConfig | None:
    """The config under which `decode_linear` beats cuBLAS for a decoder layer's projection
    (`kind`: qkv, o, gate_up, down) of `rows` tokens in `dtype`, or None where cuBLAS stays
    faster or it was not measured (4-byte dtypes: the fp32 path is a parity reference).

    The gain is programmatic dependent launch (kernels/_pdl.py): launched early, the kernel's
    grid is up while the previous kernel drains, and it lets the next one do the same; cuBLAS
    launches take part in neither. Without PDL this kernel only ties cuBLAS (or loses: the
    batch-64 `down` projection, K = 8192, where cuBLAS splits K), so it is used only where PDL is
    on and only on Hopper (compute capability 9.x), where the table was measured: a 16-layer
    chain of RMSNorm + projection in a CUDA graph, Llama-3.2-1B shapes, on an H200, µs a layer,
    cuBLAS -> ours: 1 row qkv 7.7-8.4 -> 6.8, o 7.9 -> 5.9, gate_up 20.9 -> 19.0, down 15.1 ->
    13.5; 64 rows qkv 8.9-9.2 -> 8.0, o 8.4 -> 6.9, gate_up 22.4 -> 21.0, down 16.3 vs 18.0
    unsplit, so there `down` is split over K in 4 (cuBLAS splits it too, then reduces in a kernel of
    its own): its fp32 partials go to the next add+RMSNorm, which sums them (`rms_norm` takes
    them as x); down + reduce + add&norm 15.2-15.5 -> 13.3 (benchmarks/RESULTS.md, 2026-12-03
    session 13). Session 14 timed each projection with its consumer (`benchmarks/projections.py`):
    `gate_up` carries SwiGLU in its epilogue (`decode_linear_glu`; with the act, 1 row 21.2 ->
    19.2, 64 rows 23.2 -> 21.0). Splitting `o` gained nothing at either size; splitting the
    one-row `down` in 4 won in the chain (with the add&norm 15.3 -> 13.6) but not in the engine
    (batch-1 replay 0.962 -> 0.966 ms), so the table keeps it whole. Session 15: `qkv` carries
    rotary and the KV write in its epilogue (`kernels.qkv_rotary`; with them, 1 row 8.1 -> 7.7,
    64 rows 9.9-10.1 -> 8.9), and a paired kernel streams one gathered tile rather than two half
    tiles (SwiGLU 1 row 19.4 -> 18.7, 64 rows 21.0 -> 20.6).
    A split config is for callers that take partials (`decode_linear_partials`).
    The larger tiles need Hopper's shared memory.
    """
    if rows > MAX_ROWS or kind not in PROJECTION_CONFIGS or dtype not in (torch.bfloat16, torch.float16):
        return None
    if pdl_mode(device) == 0:
        return None
    if cuda_major(device) != 9:  # Hopper: where the table was measured
        return None
    return PROJECTION_CONFIGS[kind][rows > 16]
