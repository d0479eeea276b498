"""Decoder-layer projections at decode sizes: cuBLAS vs our weight-streaming kernel, with and
without programmatic dependent launch (PDL), in one run on one GPU (Hopper for PDL).

Each case is the chain a decode step runs 16 times: our RMSNorm, then the projection, over 16
distinct weight matrices (so no layer's weights are served from L2), captured in one CUDA graph
and replayed; µs per layer (norm included, printed alone too). Llama-3.2-1B shapes, bf16:

    qkv [3072, 2048]   o [2048, 2048]   gate_up [16384, 2048]   down [2048, 8192]

A split config (the batch-64 `down`: fp32 partials over K ranges) is timed with the add+RMSNorm
that sums its partials, and cuBLAS then with the same add+RMSNorm after it (`down+norm`).

Columns: cuBLAS with PDL on and off (the norm's PDL is all that differs), ours with the config
of `kernels.linear.projection_config` (or, with `--sweep`, the best of a sweep) with PDL on and
off, and ours ÷ cuBLAS with PDL on — the decision `projection_config` encodes.

    python benchmarks/projections.py            # the table's configs (~30 s on an H200)
    python benchmarks/projections.py --sweep    # ~110 configs a case (~3 min)
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


def check(config, rows: int, n: int, k: int) -> None:
    from splitserve.kernels.linear import decode_linear, decode_linear_partials

    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = 0.02 * torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    got = decode_linear(x, w, config=config) if config.splits == 1 else decode_linear_partials(x, w, config).sum(0)
    torch.testing.assert_close(got.float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2)


def with_norm(rows: int, n: int, project):
    """`project`, then the add+RMSNorm of the next layer over its [rows, n] result (or partials)."""
    from splitserve import kernels

    gamma = torch.ones(n, device="cuda", dtype=torch.bfloat16)
    residual = torch.zeros(rows, n, device="cuda", dtype=torch.bfloat16)
    return lambda h, w: kernels.rms_norm(project(h, w), gamma, 1e-5, residual=residual)


def sweep(rows: int, n: int, k: int):
    from splitserve.kernels.linear import LinearConfig, decode_linear

    found = []
    for bn, bk, warps, stages in itertools.product((16, 32, 64), (64, 128, 256, 512), (2, 4, 8), (2, 3, 4, 5)):
        if bn * bk * stages * 2 > 160_000 or (warps == 8 and bn == 16):
            continue
        config = LinearConfig(bn, bk, warps, stages)
        try:
            found.append((with_pdl("2", chain_us, rows, n, k, lambda h, w, c=config: decode_linear(h, w, config=c), 5), config))
        except Exception:  # out of shared memory on this GPU
            continue
    return min(found)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="time ~110 tile configs a case, report the best")
    parser.add_argument("--rows", default="1,64", help="decode batch sizes (rows of x)")
    args = parser.parse_args()
    from splitserve.kernels.linear import _PROJECTION_CONFIGS, decode_linear, decode_linear_partials

    print(f"{'rows':>4} {'proj':>9} {'norm':>6} {'cuBLAS':>7} {'pdl off':>7} {'ours':>7} {'pdl off':>7} {'ours/cuBLAS':>11}  config")
    for rows in (int(r) for r in args.rows.split(",")):
        for kind, (n, k) in SHAPES.items():
            config = sweep(rows, n, k) if args.sweep else _PROJECTION_CONFIGS[kind][rows > 16]
            ours, reference, label = None, F.linear, kind
            if config is not None:
                check(config, rows, n, k)
                ours = lambda h, w, c=config: decode_linear(h, w, config=c)  # noqa: E731
                if config.splits > 1:
                    ours = with_norm(rows, n, lambda h, w, c=config: decode_linear_partials(h, w, c))
                    reference, label = with_norm(rows, n, F.linear), f"{kind}+norm"
            norm = with_pdl("2", chain_us, rows, n, k, None)
            cublas = [with_pdl(m, chain_us, rows, n, k, reference) for m in ("2", "0")]
            mine = [with_pdl(m, chain_us, rows, n, k, ours) for m in ("2", "0")] if ours else [float("nan")] * 2
            print(f"{rows:>4} {label:>9} {norm:>6.2f} {cublas[0]:>7.2f} {cublas[1]:>7.2f} {mine[0]:>7.2f} {mine[1]:>7.2f} "
                  f"{mine[0] / cublas[0]:>11.2f}  {tuple(config) if config else 'cuBLAS (table)'}", flush=True)


if __name__ == "__main__":
    main()
