"""`splitserve bench router`: the command line over router/bench.py's replay."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from splitserve.router.bench import (
    BENCH_POLICIES,
    DEFAULT_POLICIES,
    DEFAULT_TRACE,
    SimConfig,
    load_trace,
    run_bench,
    synthetic_trace,
)
from splitserve.router.policy import PolicyConfig

DESCRIPTION = """\
Replay a Mooncake-format trace (JSON lines: timestamp ms, input_length,
output_length, hash_ids = chained 512-token block ids) against N simulated
prefill workers through the router's real code: ClusterView.snapshot (prefix
index lookup + load) and policy.choose_prefill. Every worker has an LRU block
cache mirrored into the prefix index and a load model. Prints, per policy, the
fraction of prompt blocks served from cache, the same for an oracle that sends
each request to the worker with the longest cached prefix (same cache states),
their ratio, load imbalance (max/mean requests per worker) and the decision
latency p50/p99 measured with --latency-workers workers."""

EPILOG = """\
policies: scored (routing_alpha * cached fraction + (1 - alpha) * free capacity),
longest_prefix, first_prefix_block, load_balanced (router policies) and
round_robin (a baseline: workers in turn).

example:
  splitserve bench router --workers 16 --policy scored --policy round_robin --alpha 0.5
  splitserve bench router --limit 500 --json"""


def format_table(figures: dict[str, dict], sim: SimConfig, alpha: float, latency_workers: int) -> str:
    header = (f"| policy | cached fraction | oracle fraction | ratio to oracle | max/mean load "
              f"| decision p50 / p99 ms ({latency_workers} workers) |")  # fmt: skip
    lines = [header, "|---|---:|---:|---:|---:|---:|"]
    for policy, f in figures.items():
        name = f"scored (alpha={alpha:g})" if policy == "scored" else policy
        ratio = "—" if f["ratio_to_oracle"] is None else f"{f['ratio_to_oracle']:.1%}"
        lines.append(
            f"| {name} | {f['cached_fraction']:.1%} | {f['oracle_fraction']:.1%} | {ratio} "
            f"| {f['load_imbalance']:.2f} | {f['decision_p50_ms']:.3f} / {f['decision_p99_ms']:.3f} |"
        )
    any_f = next(iter(figures.values()), None)
    if any_f is not None:
        lines.append("")
        lines.append(
            f"infinite single cache (upper bound, any policy): {any_f['ideal_fraction']:.1%} of blocks"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("target", choices=["router"], help="what to benchmark: `router` (the only one so far)")
    add(
        "--trace",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"Mooncake-format JSON-lines trace (default: {DEFAULT_TRACE} when present, else a seeded "
        "synthetic trace of 2000 requests with shared prefixes: router.bench.synthetic_trace)",
    )
    add(
        "--limit", type=int, default=None, metavar="N", help="replay only the first N requests (default: all)"
    )
    add(
        "--workers", type=int, default=16, metavar="N", help="simulated prefill workers (default %(default)s)"
    )
    add(
        "--policy",
        action="append",
        choices=BENCH_POLICIES,
        default=None,
        metavar="P",
        help=f"policy to run, repeatable; one of {', '.join(BENCH_POLICIES)} "
        f"(default: {', '.join(DEFAULT_POLICIES)})",
    )
    add(
        "--alpha",
        "--routing-alpha",
        dest="alpha",
        type=float,
        default=PolicyConfig().routing_alpha,
        metavar="A",
        help="scored policy's routing_alpha in [0, 1]: cache affinity (1) against load (0) (default %(default)s, "
        "the router's default)",
    )
    add(
        "--cache-blocks",
        type=int,
        default=SimConfig.cache_blocks,
        metavar="N",
        help="LRU cache capacity of each worker, in blocks (default %(default)s)",
    )
    add(
        "--block-size",
        type=int,
        default=SimConfig.block_size,
        metavar="TOKENS",
        help="tokens per trace block (hash_ids entry) (default %(default)s, Mooncake's)",
    )
    add(
        "--prefill-tokens-per-s",
        type=float,
        default=SimConfig.prefill_tokens_per_s,
        metavar="R",
        help="load model: uncached prompt tokens a worker prefills per second (default %(default)g)",
    )
    add(
        "--decode-step-s",
        type=float,
        default=SimConfig.decode_step_s,
        metavar="S",
        help="load model: seconds per output token (default %(default)g)",
    )
    add(
        "--max-running",
        type=int,
        default=SimConfig.max_running,
        metavar="N",
        help="the router's --max-running-per-worker: load = in-flight / N (default %(default)s, the router's)",
    )
    add(
        "--time-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="multiply the trace's inter-arrival times by X (< 1 replays faster, more load; default %(default)s)",
    )
    add(
        "--latency-workers",
        type=int,
        default=64,
        metavar="N",
        help="workers for the decision-latency replay (default %(default)s; = --workers reuses the main replay)",
    )
    add("--json", action="store_true", help="print one JSON object keyed by policy instead of the table")


def run(args: argparse.Namespace) -> int:
    trace = args.trace if args.trace is not None else DEFAULT_TRACE
    synthetic = args.trace is None and not trace.is_file()  # runs anywhere, offline
    if not synthetic and not trace.is_file():
        print(
            f"error: trace {trace} not found; pass --trace PATH (a Mooncake-format .jsonl)", file=sys.stderr
        )
        return 2
    for name in ("workers", "cache_blocks", "block_size", "max_running", "latency_workers"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if not 0.0 <= args.alpha <= 1.0:
        print("error: --alpha must be in [0, 1]", file=sys.stderr)
        return 2
    try:
        requests = synthetic_trace(args.limit or 2000, block_size=args.block_size) if synthetic else load_trace(trace, args.limit)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sim = SimConfig(
        num_workers=args.workers, cache_blocks=args.cache_blocks, block_size=args.block_size,
        prefill_tokens_per_s=args.prefill_tokens_per_s, decode_step_s=args.decode_step_s,
        max_running=args.max_running, time_scale=args.time_scale,
    )  # fmt: skip
    policies = tuple(dict.fromkeys(args.policy or DEFAULT_POLICIES))
    started = time.perf_counter()
    figures = run_bench(requests, policies, sim, args.alpha, args.latency_workers)
    if args.json:
        print(json.dumps(figures))
    else:
        source = "a synthetic trace (seed 0; no --trace given and no file at the default path)" if synthetic else trace
        print(f"{len(requests)} requests from {source}, {sim.num_workers} workers x {sim.cache_blocks} blocks "
              f"(LRU), alpha={args.alpha:g}, {time.perf_counter() - started:.1f} s\n")  # fmt: skip
        print(format_table(figures, sim, args.alpha, args.latency_workers))
    return 0
