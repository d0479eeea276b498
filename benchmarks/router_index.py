"""Micro-benchmark of the router's prefix index and routing decision at cluster scale.

    python benchmarks/router_index.py                      # 64 workers, 1M distinct cached blocks
    python benchmarks/router_index.py --workers 128 --blocks 2000000

Builds a PrefixIndex holding `--blocks` distinct block hashes, laid out as
prompts of `--prompt-blocks` chained blocks, each prompt cached (as a prefix
of random length, one copy whole) on `--copies` random workers. Then measures:

  lookups/s         PrefixIndex.lookup of a prompt: a cached prefix of a random prompt + 8 new blocks
  decision p50/p99  ClusterView.snapshot + policy.route (scored), half the workers prefill, half decode

Prints one line per figure; `--json` prints them as one JSON object. Pure
CPU, no network; the numbers are for one core of this machine.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import time

from splitserve.control_plane.shard_spec import Role
from splitserve.router.cluster_view import ClusterView
from splitserve.router.policy import PolicyConfig, route
from splitserve.router.workers import WorkerEndpoint


def build(view: ClusterView, num_workers: int, num_blocks: int, prompt_blocks: int, copies: int, rng: random.Random):
    worker_ids = [f"w{n:03d}" for n in range(num_workers)]
    prompts = []
    for _ in range(num_blocks // prompt_blocks):
        prompt = [rng.randbytes(16) for _ in range(prompt_blocks)]
        prompts.append(prompt)
        holders = rng.sample(worker_ids, copies)
        view.index.store(holders[0], prompt)  # one full copy, so every block is in the index
        for worker_id in holders[1:]:
            view.index.store(worker_id, prompt[: rng.randint(1, prompt_blocks)])
    return worker_ids, prompts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=1_000_000, help="distinct cached blocks in the index")
    parser.add_argument("--prompt-blocks", type=int, default=64, help="blocks per prompt (64 x 16 tokens = 1k tokens)")
    parser.add_argument("--copies", type=int, default=2, help="workers caching each prompt")
    parser.add_argument("--lookups", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)

    view = ClusterView(block_size=16, max_running_per_worker=256)
    started = time.perf_counter()
    worker_ids, prompts = build(view, args.workers, args.blocks, args.prompt_blocks, args.copies, rng)
    build_s = time.perf_counter() - started
    view.set_workers({
        w: WorkerEndpoint(w, f"127.0.0.1:{10000 + n}", Role.PREFILL if n % 2 == 0 else Role.DECODE)
        for n, w in enumerate(worker_ids)
    })  # fmt: skip
    queries = []
    for _ in range(args.lookups):
        prompt = rng.choice(prompts)
        queries.append(prompt[: rng.randint(1, len(prompt))] + [rng.randbytes(16) for _ in range(8)])

    started = time.perf_counter()
    hits = sum(1 for query in queries if view.index.lookup(query))
    lookup_s = time.perf_counter() - started

    config, latencies = PolicyConfig(policy="scored"), []
    for query in queries[: min(len(queries), 5000)]:
        started = time.perf_counter()
        route(view.snapshot(query, len(query) * 16), config)
        latencies.append((time.perf_counter() - started) * 1e3)
    latencies.sort()
    figures = {
        "workers": args.workers,
        "distinct_blocks": view.index.num_distinct_blocks,
        "worker_block_entries": sum(view.index.num_blocks(w) for w in worker_ids),
        "build_s": round(build_s, 2),
        "lookups_per_s": round(len(queries) / lookup_s),
        "lookup_hit_fraction": round(hits / len(queries), 3),
        "decision_p50_ms": round(statistics.median(latencies), 4),
        "decision_p99_ms": round(latencies[int(len(latencies) * 0.99) - 1], 4),
        "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }
    if args.json:
        print(json.dumps(figures))
    else:
        for name, value in figures.items():
            print(f"{name:>22}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
