"""Batched device sampling (kernels/sampling.py): the threshold path against the masked-logits
path, side by side in one run, per call (host-timed from the first launch to a device sync,
so launch overhead counts: it is what a decode step waits for).

    python benchmarks/sampler.py [--vocab 128256] [--batches 1,64] [--iters 50]

Needs a CUDA device. Rows: temperature 0.8, top-k 50, top-p 0.95 (the threshold path);
the same with the flags withheld (masks first: ~30 torch ops); top-p alone (a full sort);
temperature alone; and `torch.argmax` (greedy) for scale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from kernels import eager_latency  # noqa: E402


def _cases(n: int, vocab: int) -> list:
    from splitserve.kernels.sampling import sample_rows

    x = torch.randn(n, vocab, device="cuda")
    t = torch.full((n,), 0.8, device="cuda")
    k = torch.full((n,), 50, device="cuda", dtype=torch.long)
    top_p = torch.full((n,), 0.95, device="cuda")
    seeds = torch.arange(n, device="cuda")
    none = torch.zeros_like(k)
    return [
        ("top-k 50 + top-p 0.95, threshold path",
         lambda: sample_rows(x, t, k, top_p, seeds, max_top_k=50, any_top_p=True, top_p_within_top_k=True)),
        ("the same, masked-logits path", lambda: sample_rows(x, t, k, top_p, seeds)),
        ("top-p 0.95 alone (full sort)",
         lambda: sample_rows(x, t, none, top_p, seeds, max_top_k=0, any_top_p=True, top_p_within_top_k=False)),
        ("temperature alone",
         lambda: sample_rows(x, t, none, top_p * 0, seeds, max_top_k=0, any_top_p=False, top_p_within_top_k=True)),
        ("torch.argmax (greedy)", lambda: x.argmax(-1)),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/sampler.py needs a CUDA device")
    print(f"{'batch':>5} {'case':<38} {'us/call':>9} {'÷ threshold path':>17}")
    for n in (int(b) for b in args.batches.split(",")):
        base = None
        for name, fn in _cases(n, args.vocab):
            took = eager_latency(fn, args.iters)
            base = base or took
            print(f"{n:>5} {name:<38} {took * 1e6:>9.1f} {took / base:>17.2f}")


if __name__ == "__main__":
    main()
