"""Block checksums of a handoff (engine/handoff_checksums.py) beside a plain copy of the same bytes.

A decode worker verifies every imported block's checksum before it uses the KV, and a prefill
worker computes them when it pins a handoff, so on CPU their speed is part of every import.
This times `partial_block_checksums` over one request's blocks of a Llama-3.2-1B-shaped pool
(16 layers, 8 kv heads, head_dim 64, block 16, bf16) against a copy of as many bytes, interleaved
in one run (best and median of --repeats each):

- `tp1 run`: a tp=1 rank, the request's blocks one run (the common case);
- `tp1 scattered`: the same blocks in shuffled order (a gather first);
- `tp2 rank`: a tp=2 rank's half of the heads (a resharded import's share).

On CPU each row is timed in both forms of the word sums: `int` (uint16 words summed straight into
int32, the CPU default) and `float` (widened to float32 first, the form torch takes on CUDA when
the Triton kernel does not fit); `int/float` is their speed ratio. On CUDA the Triton kernel runs.

    python benchmarks/checksums.py                    # CPU, 1 thread, 1k and 8k tokens
    python benchmarks/checksums.py --threads 2 --tokens 1024,8192,32768
    python3 benchmarks/checksums.py --gpu             # the H200: the kernel against a device copy
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from splitserve.engine import handoff_checksums
from splitserve.engine.handoff_checksums import partial_block_checksums
from splitserve.engine.transfer.layout import KVLayout

LAYERS, HEADS, HEAD_DIM, BLOCK = 16, 8, 64, 16


def _pool(num_blocks: int, heads: int, device: str) -> list[torch.Tensor]:
    shape = (2, num_blocks, heads, BLOCK, HEAD_DIM)
    if device == "cuda":
        return [torch.randn(shape, device=device).to(torch.bfloat16) for _ in range(LAYERS)]
    from splitserve.engine.host_memory import huge_page_empty

    return [huge_page_empty(shape, torch.bfloat16).copy_(torch.randn(shape)) for _ in range(LAYERS)]


def _timed(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def _row(name: str, calls: dict[str, Callable[[], object]], nbytes: int, repeats: int, sync) -> None:
    """Time `calls` interleaved (order alternating each round); print ms, GB/s and ratios."""
    times: dict[str, list[float]] = {k: [] for k in calls}
    order = list(calls)
    for fn in calls.values():  # warm-up
        fn()
    for _ in range(repeats):
        for k in order:
            times[k].append(_timed(calls[k], sync))
        order.reverse()
    best = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    cells = [f"{name:>14} {nbytes / 1e6:8.1f}"]
    for k in calls:
        cells.append(f"{k} {best[k] * 1e3:7.2f} / {med[k] * 1e3:7.2f} ms {nbytes / best[k] / 1e9:6.2f} GB/s")
    ratios = [f"{k}/copy {best['copy'] / best[k]:5.1%} / {med['copy'] / med[k]:5.1%}" for k in calls if k != "copy"]
    if "int" in calls and "float" in calls:
        ratios.append(f"int/float {best['float'] / best['int']:.2f}x / {med['float'] / med['int']:.2f}x")
    print("  ".join(cells + ratios), flush=True)


def _checksum(kv, layout, rank, blocks, integer: bool | None) -> Callable[[], object]:
    def call():
        if integer is not None:
            handoff_checksums.CPU_INTEGER_FORM = integer
        try:
            return partial_block_checksums(kv, layout, rank, blocks)
        finally:
            handoff_checksums.CPU_INTEGER_FORM = True

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true", help="pools on cuda:0 (the checksum kernel)")
    parser.add_argument("--tokens", default="1024,8192", help="prompt lengths, comma list")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per row")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: a plain memcpy)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = "cuda" if args.gpu else "cpu"
    sync = torch.cuda.synchronize if args.gpu else (lambda: None)
    tokens = [int(t) for t in args.tokens.split(",")]
    num_blocks = max(tokens) // BLOCK + 8
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  {device}, {LAYERS} layers x {HEADS} kv heads x {HEAD_DIM}, "
          f"block {BLOCK}, bf16, {args.threads} thread(s); ms best / median of {args.repeats}", flush=True)
    pools = {1: _pool(num_blocks, HEADS, device), 2: _pool(num_blocks, HEADS // 2, device)}
    copy_src = _pool(num_blocks, HEADS, device)
    for n_tokens in tokens:
        n = n_tokens // BLOCK
        run = list(range(4, 4 + n))
        scattered = random.Random(n).sample(range(num_blocks), n)
        for name, tp, blocks in (("tp1 run", 1, run), ("tp1 scattered", 1, scattered), ("tp2 rank", 2, run)):
            layout = KVLayout(dtype="bfloat16", block_size=BLOCK, tp=tp, pp=1, num_layers=LAYERS,
                              num_kv_heads=HEADS, head_dim=HEAD_DIM)
            kv = pools[tp]
            nbytes = LAYERS * 2 * n * (HEADS // tp) * BLOCK * HEAD_DIM * 2
            width = HEADS // tp
            srcs = [t[:, 4:4 + n, :width] for t in copy_src]
            dsts = [torch.empty_like(s) for s in srcs]

            def copy(srcs=srcs, dsts=dsts):
                for d, s in zip(dsts, srcs, strict=True):
                    d.copy_(s)

            calls: dict[str, Callable[[], object]] = {"copy": copy}
            if args.gpu:
                calls["kernel"] = _checksum(kv, layout, 0, blocks, None)
            else:
                calls["int"] = _checksum(kv, layout, 0, blocks, True)
                calls["float"] = _checksum(kv, layout, 0, blocks, False)
            sums = [fn() for k, fn in calls.items() if k != "copy"]
            assert all(torch.equal(s, sums[0]) for s in sums), "the two forms disagree"
            _row(f"{name} {n_tokens}", calls, nbytes, args.repeats, sync)


if __name__ == "__main__":
    main()
