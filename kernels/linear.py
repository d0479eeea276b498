"""Decode-batch linear layer (the LM head; decoder projections on Hopper): out = x @ w^T for few rows, fp32 out.

    x [M, K] (M <= MAX_ROWS), w [N, K] -> out [M, N] in out_dtype (default x.dtype)

At decode batch sizes a projection reads its whole weight matrix to produce a
few rows, so time is weight bytes / HBM bandwidth. For the LM head ([128k, 2048]
for Llama 3, 525 MB in bf16) cuBLAS plus the `.float()` of the logits took
173 µs at 64 rows on an H200 (3.0 TB/s) against 145 µs here (3.6 TB/s), and
132 vs 124 µs at one row: grid N / BLOCK_N, each program reads its weight tile
[BLOCK_N, K] once and the few rows of x (served from L2), accumulates in fp32
and stores the result in the asked dtype, so fp32 logits need no second pass.

Decoder-layer projections use it too, but only where it is launched with
programmatic dependent launch (Hopper): on its own the kernel at best matched
cuBLAS there (benchmarks/RESULTS.md, 2026-12-02); overlapping its launch with
the previous kernel's drain is what wins (`kernels.projection_configs`).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import cdiv, check_last_dim_contiguous, dot_precision, next_power_of_2
from ._pdl import pdl_launch
from .argmax import merge_argmax
from .weight_stream import first_weight_tile, rows_rstd, split_halves, stream_weight_tile

__all__ = [
    "MAX_ROWS",
    "LinearConfig",
    "RowNorm",
    "decode_linear",
    "decode_linear_add",
    "decode_linear_glu",
    "decode_linear_partials",
    "linear_reference",
]

MAX_ROWS = 64
"""Most rows (decode tokens) the kernel takes; larger batches are compute-shaped, for cuBLAS."""


@triton.jit
def _linear_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    sq_ptr,
    res_ptr,
    count_ptr,
    amax_val_ptr,
    amax_idx_ptr,
    keep_ptr,
    M,
    N,
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,
    stride_sq,
    stride_rm,
    eps,
    K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    GLU: tl.constexpr,
    EARLY: tl.constexpr,
    ADD: tl.constexpr,
    NORM: tl.constexpr,
    PARTS: tl.constexpr,
    PARTS_BLOCK: tl.constexpr,
    SPLITS: tl.constexpr,
    ARGMAX: tl.constexpr,
    KEEP: tl.constexpr,
    PDL: tl.constexpr,
):
    """GLU: w holds N gate rows then N up rows; program n's tile is BLOCK_N / 2 gate rows and
    the matching up rows (one tile: two tiles of half the rows, streamed as a pair, were ~0.5 µs
    a layer slower on an H200), and it stores silu(gate) * up, rounded as `silu_and_mul` rounds
    the unfused product.
    ADD: the residual stream at res_ptr is updated in place to round(res + round(x @ w^T)), and
    program n stores its columns' sums of squares of the new rows at sq_ptr[n]
    (`decode_linear_add`). Split over K (SPLITS ranges), each program stores its fp32 partial at
    out_ptr and counts itself in at count_ptr[n]; the last of a column tile to arrive sums the
    partials in range order (as `rms_norm` sums them), does the add, and sets the count back to 0
    for the next launch.
    NORM: the sums are of an RMSNorm of x whose weight is folded into w (`RowNorm`): each row is
    scaled by its 1 / rms, from PARTS such sums at sq_ptr, before the epilogue.
    ARGMAX: program n also stores, per row, the maximum of its stored columns and the first column
    holding it at amax_val_ptr / amax_idx_ptr [M, tiles] (`decode_linear(..., argmax=)`).
    KEEP: only rows whose flag at keep_ptr [M] is nonzero are stored (the argmax still sees every
    row: it reduces the values in registers)."""
    HALF_N: tl.constexpr = BLOCK_N // 2
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    if GLU:
        r = tl.arange(0, BLOCK_N)
        cols_n = tl.program_id(0) * HALF_N + r % HALF_N
        tile_rows = cols_n + (r // HALF_N) * N
        offs_n = tl.program_id(0) * HALF_N + tl.arange(0, HALF_N)
    else:
        cols_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        tile_rows = cols_n
        offs_n = cols_n
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_rows = w_ptr + tile_rows.to(tl.int64)[:, None] * stride_wn
    split = tl.program_id(1)  # program (n, s) sums K range s (one range, the whole K, unless split)
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    w_first = first_weight_tile(w_rows, cols_n < N, k_start, k_end, BLOCK_K, PDL, EARLY)
    acc = stream_weight_tile(x_rows, w_rows, w_first, mask_m, cols_n < N, k_start, k_end, BLOCK_M, BLOCK_N, BLOCK_K,
                             DOT_PRECISION, EARLY)
    if NORM:
        acc = acc * rows_rstd(sq_ptr, offs_m, mask_m, stride_sq, eps, K, PARTS, PARTS_BLOCK)[:, None]
    dtype = res_ptr.dtype.element_ty if ADD else out_ptr.dtype.element_ty
    if GLU:
        acc_gate, acc_up = split_halves(acc, BLOCK_M, HALF_N)
        gate = acc_gate.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = act * acc_up.to(dtype).to(tl.float32)
    out_ptrs = out_ptr + split.to(tl.int64) * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    mask = mask_m[:, None] & (offs_n < N)[None, :]
    if ADD:  # the residual add of the next RMSNorm, and that norm's statistics in part
        last = True
        if SPLITS > 1:
            tl.store(out_ptrs, acc, mask=mask)
            tl.debug_barrier()  # every thread's partial is stored before the count says so
            last = tl.atomic_add(count_ptr + tl.program_id(0), 1, sem="acq_rel") == SPLITS - 1
        if last:
            if SPLITS > 1:
                tl.atomic_xchg(count_ptr + tl.program_id(0), 0)
                part_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
                acc = tl.load(part_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
                for part in tl.static_range(1, SPLITS):
                    acc += tl.load(part_ptrs + part * stride_os, mask=mask, other=0.0, cache_modifier=".cg")
            res_ptrs = res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :]
            res = tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
            new = (acc.to(dtype).to(tl.float32) + res).to(dtype)
            tl.store(res_ptrs, new, mask=mask)
            new32 = new.to(tl.float32)
            tl.store(sq_ptr + tl.program_id(0) * stride_sq + offs_m, tl.sum(new32 * new32, 1), mask=mask_m)
    else:
        if KEEP:  # only the rows the caller reads
            kept = tl.load(keep_ptr + offs_m, mask=mask_m, other=0) != 0
            tl.store(out_ptrs, acc.to(dtype), mask=mask & kept[:, None])
        else:
            tl.store(out_ptrs, acc.to(dtype), mask=mask)
        if ARGMAX:  # of the values as stored (rounded to dtype); masked columns never win
            vals = tl.where(mask, acc.to(dtype).to(tl.float32), float("-inf"))
            best = tl.max(vals, 1)
            first = tl.min(tl.where(vals == best[:, None], offs_n[None, :], N), 1)
            part_at = offs_m * tl.num_programs(0) + tl.program_id(0)
            tl.store(amax_val_ptr + part_at, best, mask=mask_m)
            tl.store(amax_idx_ptr + part_at, first, mask=mask_m)


def early_weights(splits: int) -> bool:
    """Whether programs load their first weight tile before the PDL wait (`first_weight_tile`):
    for configs split over K, whose programs stream a K range each, so that tile is a larger
    share of their weights. On an H200 (benchmarks/RESULTS.md, 2026-12-04) it made the split
    64-row `down` projection faster (17.7 -> 16.7 µs a layer with its add&norm) and every unsplit
    projection slower (e.g. 64-row gate_up + SwiGLU 20.8 -> 24.3). `SPLITSERVE_EARLY_WEIGHTS=0`
    turns it off (an A/B switch for benchmarks)."""
    return splits > 1 and os.environ.get("SPLITSERVE_EARLY_WEIGHTS", "1") != "0"


class LinearConfig(tuple):
    """(block_n, block_k, num_warps, num_stages, splits); the default is the best of a sweep at
    the Llama-3 LM-head shape on an H200, 1 and 64 rows. `splits` > 1: K is cut into that many
    ranges, each summed by its own programs into an fp32 partial (`decode_linear_partials`)."""

    __slots__ = ()

    def __new__(cls, block_n: int = 128, block_k: int = 128, num_warps: int = 4, num_stages: int = 4, splits: int = 1):
        return super().__new__(cls, (block_n, block_k, num_warps, num_stages, splits))

    @property
    def splits(self) -> int:
        return self[4]


def row_tile(rows: int) -> int:
    """The kernel's row tile for `rows` rows (a compiled constant)."""
    return max(16, next_power_of_2(rows))


def row_variant(rows: int) -> tuple[int, str]:
    """Which compiled variant of `_linear_kernel` a row count runs: its row tile, and how
    Triton specializes the integer M (1, a multiple of 16, or neither)."""
    return row_tile(rows), "one" if rows == 1 else "x16" if rows % 16 == 0 else "other"


def rows_per_variant() -> tuple[int, ...]:
    """The smallest row count of each variant up to MAX_ROWS: running each once compiles
    every form a call of any row count can need (the warm-up does, engine/warmup.py)."""
    first: dict[tuple[int, str], int] = {}
    for rows in range(1, MAX_ROWS + 1):
        first.setdefault(row_variant(rows), rows)
    return tuple(sorted(first.values()))


def decode_linear(
    x: torch.Tensor, weight: torch.Tensor, *, out_dtype: torch.dtype | None = None, config: LinearConfig | None = None,
    argmax: torch.Tensor | None = None, keep_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K], weight [N, K], rows contiguous, M <= MAX_ROWS -> [M, N] in out_dtype
    (default x.dtype), fp32 accumulation; fp32 inputs use IEEE (not tf32) products.
    `argmax`: int64 [M], written with each row's argmax of the result (the first index of its
    maximum, as `torch.argmax` of the returned tensor): a greedy step's tokens from the LM head's
    epilogue — each program reduces the columns it stores, one small launch merges the
    partials — instead of a second pass over the logits (`kernels.argmax_rows` reads 33 MB of
    fp32 logits again at 64 rows of a 128k vocabulary).
    `keep_rows`: integer [M] on x's device; only the rows where it is nonzero are stored, the
    others of the result are left unwritten (their argmax is still taken): a decode graph's greedy
    rows need only their token, and not storing their logits saves 33 MB of writes a batch-64
    step of a 128k vocabulary (engine/cuda_graphs.py)."""
    if config is not None and config.splits != 1:
        raise ValueError("decode_linear() takes an unsplit config; use decode_linear_partials()")
    if argmax is not None and (argmax.shape != (x.shape[0],) or argmax.dtype != torch.int64
                               or argmax.device != x.device):
        raise ValueError(f"argmax must be int64 [{x.shape[0]}] on {x.device}, got {tuple(argmax.shape)} "
                         f"{argmax.dtype} on {argmax.device}")
    if keep_rows is not None and (keep_rows.shape != (x.shape[0],) or keep_rows.dtype.is_floating_point
                                  or keep_rows.dtype.is_complex or keep_rows.device != x.device):
        raise ValueError(f"keep_rows must be integer [{x.shape[0]}] on {x.device}, got {tuple(keep_rows.shape)} "
                         f"{keep_rows.dtype} on {keep_rows.device}")
    return _launch(x, weight, out_dtype, config, argmax=argmax, keep_rows=keep_rows)


def decode_linear_glu(
    x: torch.Tensor, weight: torch.Tensor, config: LinearConfig | None = None, norm: RowNorm | None = None
) -> torch.Tensor:
    """SwiGLU of a fused gate/up projection in one launch: x [M, K], weight [2I, K] (gate rows
    first) -> silu(x @ gate^T) * (x @ up^T) [M, I] in x.dtype, rounded as `silu_and_mul` of
    `decode_linear`'s result (each product rounded, then silu, then the product). A program
    reads `config.block_n` weight rows, half gate and half up, so a config keeps the tile
    bytes of the plain projection; the [M, 2I] intermediate and the activation's launch go.
    `norm`: x is the residual stream a `decode_linear_add` just wrote, and the projection is of
    its RMSNorm, γ folded into `weight` (`RowNorm`): the norm's launch goes too."""
    if weight.dim() == 2 and weight.shape[0] % 2:
        raise ValueError(f"weight must be [2 * I, K], got {tuple(weight.shape)}")
    if config is not None and config.splits != 1:
        raise ValueError("decode_linear_glu() takes an unsplit config: silu of partial sums is not their silu")
    return _launch(x, weight, None, config, glu=True, norm=norm)


class RowNorm(NamedTuple):
    """An RMSNorm folded into the next projection (`decode_linear_glu(..., norm=)`,
    `decode_qkv_rotary(..., norm=)`): x is the residual stream, the projection's weight holds the
    norm's weight γ multiplied into its columns (W * γ, `engine/models/fused.py`), and the kernel
    scales each row's sums by rsqrt(mean(x^2) + eps) — from `squares`, the partial sums of
    squares of x's rows that `decode_linear_add` returned with x. So x streams into the MMA
    untouched and the norm takes no launch; against the unfused norm (x * rstd rounded, times γ
    rounded, then the GEMM) only the roundings move: γ's into the weights, rstd's after the sum."""

    eps: float
    squares: torch.Tensor


def check_row_norm(norm: RowNorm | None, rows: int) -> None:
    if norm is not None and (norm.squares.dim() != 2 or norm.squares.shape[1] != rows):
        raise ValueError(f"RowNorm squares {tuple(norm.squares.shape)} do not fit {rows} rows")


def decode_linear_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, config: LinearConfig | None = None
                      ) -> torch.Tensor:
    """The projection of x [M, K] by weight [N, K] added to the residual stream [M, N] in place,
    rounded as `rms_norm(..., residual=)` adds `decode_linear`'s result: residual <-
    round(residual + round(x @ w^T)). Returns fp32 [P, M]: each of the kernel's P column tiles'
    sums of squares of the new rows, the statistics of the next RMSNorm (`RowNorm`), which the
    next projection then takes in its own launch instead of a norm kernel of its own. A split
    config sums its partials in the kernel too: the last program of each column tile to finish
    adds them (`_linear_kernel`), so no reduction takes a launch either."""
    if residual.dim() != 2 or residual.shape != (x.shape[0], weight.shape[0]) or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not fit x {tuple(x.shape)} "
                         f"{x.dtype} @ weight {tuple(weight.shape)}^T")
    check_last_dim_contiguous("residual", residual)
    return _launch(x, weight, None, config, residual=residual)


def decode_linear_partials(x: torch.Tensor, weight: torch.Tensor, config: LinearConfig) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T as fp32 partial sums [S, M, N] over S <= `config.splits` ranges
    of K (fewer where K holds fewer whole tiles): their sum, rounded once, is `decode_linear`'s
    result up to summation order."""
    return _launch(x, weight, torch.float32, config)


def _launch(x, weight, out_dtype, config, glu: bool = False, residual=None, norm: RowNorm | None = None,
            argmax: torch.Tensor | None = None, keep_rows: torch.Tensor | None = None):
    """`out`, or with `residual` the squares' partials (`decode_linear_add`)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}")
    rows, k = x.shape
    n = weight.shape[0] // 2 if glu else weight.shape[0]
    if rows > MAX_ROWS:
        raise ValueError(f"decode_linear() takes at most {MAX_ROWS} rows, got {rows}")
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    if config is None:  # 4-byte operands: half the K tile and fewer stages fit shared memory
        config = LinearConfig() if x.element_size() <= 2 else LinearConfig(block_k=64, num_stages=2)
    block_n, block_k, num_warps, num_stages, splits = config
    if glu:
        block_n = max(32, block_n)  # half the tile's rows gate, half up; each half a dot's 16 columns at least
    block_k = min(block_k, max(16, next_power_of_2(k)))
    k_per_split = cdiv(cdiv(k, splits), block_k) * block_k  # whole K tiles per range
    ranges = cdiv(k, k_per_split)  # a small K may need fewer ranges than asked: that many partials
    tiles = cdiv(n, block_n // 2 if glu else block_n)
    if residual is not None and ranges == 1:
        out = residual
    elif residual is not None:  # the split programs' fp32 partials
        out = torch.empty(ranges, rows, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(*((ranges,) if splits > 1 else ()), rows, n, dtype=out_dtype or x.dtype, device=x.device)
    if residual is not None:  # written: this launch's statistics
        squares = torch.empty(tiles, rows, dtype=torch.float32, device=x.device)
    else:  # read (NORM), or an unused pointer
        squares = x if norm is None else norm.squares
    check_row_norm(norm, rows)
    early = early_weights(ranges)
    if argmax is not None:  # unsplit, plain: the partials of each program's stored columns
        amax_val = torch.empty(rows, tiles, dtype=torch.float32, device=x.device)
        amax_idx = torch.empty(rows, tiles, dtype=torch.int32, device=x.device)
    else:
        amax_val = amax_idx = x  # unused pointers
    if rows > 0:
        _linear_kernel[(tiles, ranges)](
            x, weight, out, squares, residual if residual is not None else x,
            arrivals(x.device, tiles) if residual is not None and ranges > 1 else x, amax_val, amax_idx,
            keep_rows if keep_rows is not None else x,
            rows, n, x.stride(0), weight.stride(0), out.stride(-2), out.stride(0) if splits > 1 else 0, squares.stride(0),
            residual.stride(0) if residual is not None else 0, norm.eps if norm is not None else 0.0,
            K=k, K_PER_SPLIT=k_per_split, BLOCK_M=row_tile(rows), BLOCK_N=block_n, BLOCK_K=block_k,
            DOT_PRECISION=dot_precision(x.dtype), GLU=glu, EARLY=early, ADD=residual is not None, NORM=norm is not None,
            PARTS=norm.squares.shape[0] if norm is not None else 1,
            PARTS_BLOCK=parts_block(norm), SPLITS=ranges, ARGMAX=argmax is not None,
            KEEP=keep_rows is not None,
            num_warps=num_warps,
            num_stages=max(1, num_stages - 1) if early else num_stages,  # the early tile is a stage
            **pdl_launch(x.device),
        )
        if argmax is not None:
            merge_argmax(amax_val, amax_idx, argmax, n)
    return squares if residual is not None else out


def parts_block(norm: RowNorm | None) -> int:
    """How many of a `RowNorm`'s partial sums a program loads at a time (`rows_rstd`)."""
    return min(32, next_power_of_2(norm.squares.shape[0])) if norm is not None else 1


_ARRIVALS: dict[tuple, torch.Tensor] = {}


def arrivals(device: torch.device, tiles: int) -> torch.Tensor:
    """int32 zeros [tiles] on `device`, one per column tile, where the programs of a split
    `decode_linear_add` count themselves in; the kernel leaves them 0 again, so one buffer per
    device and stream serves every launch (and every CUDA graph that captured one: it is never
    freed). Allocated on first use — before capture, by the warm-up's eager steps."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream, tiles)
    if key not in _ARRIVALS:
        _ARRIVALS[key] = torch.zeros(tiles, dtype=torch.int32, device=device)
    return _ARRIVALS[key]


def linear_reference(x: torch.Tensor, weight: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """F.linear in fp32, rounded to out_dtype (default x.dtype)."""
    return (x.float() @ weight.float().t()).to(out_dtype or x.dtype)
