"""Decoder-layer projections at decode sizes: cuBLAS vs our weight-streaming kernel, with and
without programmatic dependent launch (PDL), in one run on one GPU (Hopper for PDL).

Each case is the chain a decode step runs 16 times: our RMSNorm, then the projection, over 16
distinct weight matrices (so no layer's weights are served from L2), captured in one CUDA graph
and replayed; µs per layer (norm included, printed alone too). Llama-3.2-1B shapes, bf16:

    qkv [3072, 2048]   o [2048, 2048]   gate_up [16384, 2048]   down [2048, 8192]

Each projection is timed with what consumes its result in the step: `qkv` with rotary and the
KV write (cuBLAS + `apply_rotary_qk_and_write_kv`; ours does them in the projection's kernel,
`decode_qkv_rotary`), `o` and `down` with the next add+RMSNorm (which sums a split config's fp32
partials over K ranges), `gate_up` with SwiGLU (cuBLAS + `silu_and_mul`; ours does it in the
projection's kernel).

Columns: cuBLAS with PDL on and off (the norm's PDL is all that differs), ours with the config
of `kernels.projection_configs.projection_config` (or, with `--sweep`, the best of a sweep) with PDL on and
off, and ours ÷ cuBLAS with PDL on — the decision `projection_config` encodes.

    python benchmarks/projections.py            # the table's configs (~30 s on an H200)
    python benchmarks/projections.py --sweep    # ~110 configs a case (~3 min)
    python benchmarks/projections.py --sweep --kinds o --rows 64 --grid "bn=16,32 splits=1,2,4"
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}
LAYERS = 16


def chain_us(rows: int, n: int, k: int, project, reps: int = 20) -> float:
    """µs a layer of a graph of LAYERS (norm -> project) pairs; `project(h, w)` or None (norm only)."""
    from splitserve import kernels

    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    gamma = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    weights = [0.02 * torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]

    def run():
        for w in weights:
            h = kernels.rms_norm(x, gamma, 1e-5)
            if project is not None:
                h = project(h, w)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm outside the capture
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / reps / LAYERS)
    return best * 1e6


def with_pdl(mode: str, fn, *args, **kwargs):
    old = os.environ.get("SPLITSERVE_PDL")
    os.environ["SPLITSERVE_PDL"] = mode
    try:
        return fn(*args, **kwargs)
    finally:
        if old is None:
            del os.environ["SPLITSERVE_PDL"]
        else:
            os.environ["SPLITSERVE_PDL"] = old


# Llama-3.2-1B attention: q / kv heads of 64 dims (qkv rows = (32 + 2 * 8) * 64), a 16-token page
HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 64, 16


class RotaryInputs:
    """cos / sin rows, a KV cache and distinct slots for `rows` decode tokens."""

    def __init__(self, rows: int):
        self.cos = torch.randn(rows, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        self.sin = torch.randn(rows, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        self.kv = torch.zeros(2, 4 * rows, KV_HEADS, PAGE, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        self.slots = torch.arange(rows, device="cuda") * (3 * PAGE + 1)

    def unfused(self, qkv: torch.Tensor) -> torch.Tensor:
        """Rotary + the KV write of a qkv projection's result (the kernel after cuBLAS); q."""
        from splitserve import kernels

        q = qkv[:, : HEADS * HEAD_DIM].view(-1, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(-1, KV_HEADS, HEAD_DIM)
        v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(-1, KV_HEADS, HEAD_DIM)
        kernels.apply_rotary_qk_and_write_kv(q, k, v, self.cos, self.sin, self.kv, self.slots)
        return q

    def fused(self, x: torch.Tensor, w: torch.Tensor, config) -> torch.Tensor:
        from splitserve import kernels

        return kernels.decode_qkv_rotary(x, w, self.cos, self.sin, self.kv, self.slots, HEADS, config)


def check(kind: str, config, rows: int, n: int, k: int) -> None:
    from splitserve.kernels.elementwise_reference import silu_and_mul_reference
    from splitserve.kernels.linear import decode_linear, decode_linear_glu, decode_linear_partials

    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = 0.02 * torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    if kind == "gate_up":
        got, want = decode_linear_glu(x, w, config), silu_and_mul_reference(F.linear(x, w))
    elif kind == "qkv":
        ours, theirs = RotaryInputs(rows), RotaryInputs(rows)
        theirs.cos, theirs.sin = ours.cos, ours.sin
        got, want = ours.fused(x, w, config), theirs.unfused(F.linear(x, w))
        torch.testing.assert_close(ours.kv.float(), theirs.kv.float(), rtol=2e-2, atol=2e-2)
    else:
        got = decode_linear(x, w, config=config) if config.splits == 1 else decode_linear_partials(x, w, config).sum(0)
        want = F.linear(x, w)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def with_norm(rows: int, n: int, project):
    """`project`, then the add+RMSNorm of the next layer over its [rows, n] result (or partials)."""
    from splitserve import kernels

    gamma = torch.ones(n, device="cuda", dtype=torch.bfloat16)
    residual = torch.zeros(rows, n, device="cuda", dtype=torch.bfloat16)
    return lambda h, w: kernels.rms_norm(project(h, w), gamma, 1e-5, residual=residual)


def stage(kind: str, rows: int, n: int, config):
    """`project(h, w)` as the decode step runs it, its consumer included: `qkv` with rotary and
    the KV write, `o` and `down` with the next add+RMSNorm (which sums a split config's
    partials), `gate_up` with SwiGLU (ours: both in the projection's kernel); config None = cuBLAS."""
    from splitserve import kernels
    from splitserve.kernels.linear import decode_linear, decode_linear_glu, decode_linear_partials

    rotary = RotaryInputs(rows) if kind == "qkv" else None
    if config is None:
        project = (lambda h, w: kernels.silu_and_mul(F.linear(h, w))) if kind == "gate_up" else F.linear
        if rotary is not None:
            project = lambda h, w: rotary.unfused(F.linear(h, w))  # noqa: E731
    elif rotary is not None:
        project = lambda h, w: rotary.fused(h, w, config)  # noqa: E731
    elif kind == "gate_up":
        project = lambda h, w: decode_linear_glu(h, w, config)  # noqa: E731
    elif config.splits > 1:
        project = lambda h, w: decode_linear_partials(h, w, config)  # noqa: E731
    else:
        project = lambda h, w: decode_linear(h, w, config=config)  # noqa: E731
    return with_norm(rows, n, project) if kind in ("o", "down") else project


def parse_grid(text: str) -> dict[str, tuple[int, ...]]:
    grid = {"bn": (16, 32, 64), "bk": (64, 128, 256, 512), "warps": (2, 4, 8), "stages": (2, 3, 4, 5), "splits": (1,)}
    for item in text.split():
        key, _, values = item.partition("=")
        if key not in grid:
            raise SystemExit(f"--grid: unknown key {key!r} (keys: {', '.join(grid)})")
        grid[key] = tuple(int(v) for v in values.split(","))
    return grid


def sweep(kind: str, rows: int, n: int, k: int, grid: dict[str, tuple[int, ...]]):
    from splitserve.kernels.linear import LinearConfig

    found = []
    for bn, bk, warps, stages, splits in itertools.product(*grid.values()):
        if bn * bk * stages * 2 > 160_000 or (warps == 8 and bn == 16) or (splits > 1 and kind not in ("o", "down")):
            continue
        config = LinearConfig(bn, bk, warps, stages, splits)
        try:
            found.append((with_pdl("2", chain_us, rows, n, k, stage(kind, rows, n, config), 5), config))
        except Exception:  # out of shared memory on this GPU
            continue
    found.sort()
    print(f"  {rows} rows {kind}: best {', '.join(f'{us:.2f} {tuple(c)}' for us, c in found[:4])}", flush=True)
    return found[0][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="time the --grid's tile configs a case, report the best")
    parser.add_argument("--grid", default="", help='sweep grid, e.g. "bn=16,32 bk=256,512 splits=1,2,4" '
                        "(keys bn bk warps stages splits; splits > 1 only for o and down)")
    parser.add_argument("--rows", default="1,64", help="decode batch sizes (rows of x)")
    parser.add_argument("--kinds", default=",".join(SHAPES), help="projections to time")
    args = parser.parse_args()
    from splitserve.kernels.projection_configs import PROJECTION_CONFIGS

    grid = parse_grid(args.grid)
    print(f"{'rows':>4} {'proj':>9} {'norm':>6} {'cuBLAS':>7} {'pdl off':>7} {'ours':>7} {'pdl off':>7} {'ours/cuBLAS':>11}  config")
    for rows in (int(r) for r in args.rows.split(",")):
        for kind in args.kinds.split(","):
            n, k = SHAPES[kind]
            config = sweep(kind, rows, n, k, grid) if args.sweep else PROJECTION_CONFIGS[kind][rows > 16]
            label = {"qkv": "qkv+rope", "o": "o+norm", "down": "down+norm", "gate_up": "gate_up+act"}.get(kind, kind)
            if config is not None:
                check(kind, config, rows, n, k)
            norm = with_pdl("2", chain_us, rows, n, k, None)
            cublas = [with_pdl(m, chain_us, rows, n, k, stage(kind, rows, n, None)) for m in ("2", "0")]
            mine = [float("nan")] * 2
            if config is not None:
                mine = [with_pdl(m, chain_us, rows, n, k, stage(kind, rows, n, config)) for m in ("2", "0")]
            print(f"{rows:>4} {label:>11} {norm:>6.2f} {cublas[0]:>7.2f} {cublas[1]:>7.2f} {mine[0]:>7.2f} {mine[1]:>7.2f} "
                  f"{mine[0] / cublas[0]:>11.2f}  {tuple(config) if config else 'cuBLAS (table)'}", flush=True)


if __name__ == "__main__":
    main()
