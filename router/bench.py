"""`splitserve bench router`: replay a Mooncake-format trace through the router's real policy code.

Each simulated worker is a prefill worker with

    an LRU cache of `--cache-blocks` blocks     (the blocks it holds are mirrored into the router's
                                                 PrefixIndex, as its KV events would be)
    a load model                                (a request is in flight from its arrival until
                                                 arrival + uncached_tokens / prefill_tokens_per_s
                                                 + output_length * decode_step_s; counted in the
                                                 router's own LoadTracker)

At every arrival the bench builds the snapshot the router builds
(`ClusterView.snapshot`: prefix-index lookup + load), runs the policy
(`policy.choose_prefill`) and then updates the chosen worker's cache and load.
Trace `hash_ids` are used directly as chained block hashes of `--block-size`
(512) tokens: Mooncake's hash of a block names its whole prefix, like ours.

Per policy it reports:

    cached_fraction   prompt blocks found in the chosen worker's cache / all prompt blocks
    oracle_fraction   the same, had every request gone to the worker with the longest cached
                      prefix of it, given the same cache states (the best this policy's
                      cluster state allowed, request by request)
    ratio_to_oracle   cached_fraction / oracle_fraction
    ideal_fraction    blocks whose prefix appeared earlier in the trace (one infinite cache):
                      an upper bound for any policy, the same for all
    load_imbalance    max / mean requests per worker
    decision p50/p99  ClusterView.snapshot + choose_prefill, timed with `--latency-workers` workers
"""

from __future__ import annotations

import heapq
import json
import statistics
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.control_plane.shard_spec import Role
from splitserve.router.cluster_view import ClusterView
from splitserve.router.policy import POLICIES, PolicyConfig, choose_prefill
from splitserve.router.workers import WorkerEndpoint

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[1].parent
    / "shared"
    / "data"
    / "traces"
    / "mooncake_synthetic_trace.jsonl"
)
"""../shared/data/traces/mooncake_synthetic_trace.jsonl, next to the repository."""

ROUND_ROBIN = "round_robin"
"""A baseline that is not a router policy: workers in turn, whatever their cache or load."""
BENCH_POLICIES = (*POLICIES, ROUND_ROBIN)
DEFAULT_POLICIES = ("scored", "longest_prefix", "first_prefix_block", "load_balanced", ROUND_ROBIN)


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    block_hashes: tuple[Hashable, ...]


def load_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """The trace's requests in arrival order (the first `limit`)."""
    requests = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(requests) >= limit:
                break
            try:
                record = json.loads(line)
                requests.append(TraceRequest(
                    record["timestamp"] / 1e3, int(record["input_length"]), int(record["output_length"]),
                    tuple(record["hash_ids"]),
                ))  # fmt: skip
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{line_no}: not a Mooncake trace record ({e})") from None
    requests.sort(key=lambda r: r.arrival_s)
    return requests


def synthetic_trace(num_requests: int = 2000, seed: int = 0, *, num_prefixes: int = 64,
                    mean_interarrival_s: float = 0.05, block_size: int = 512) -> list[TraceRequest]:
    """A seeded Mooncake-shaped trace, for when no trace file is at hand (the bench's default off
    this repository's checkout): each request is a shared prefix — one of `num_prefixes`
    (a system prompt, a document, a conversation so far: 2-24 blocks), picked with Zipf-like
    popularity (weight 1 / rank) — then 1-8 blocks of its own; Poisson arrivals; 16-512 output
    tokens. Block ids are chained as Mooncake's are: an id names its whole prefix."""
    import itertools
    import random

    rng = random.Random(seed)
    next_id = itertools.count().__next__
    prefixes = [tuple(next_id() for _ in range(rng.randint(2, 24))) for _ in range(num_prefixes)]
    weights = [1.0 / (rank + 1) for rank in range(num_prefixes)]
    requests, now = [], 0.0
    for _ in range(num_requests):
        now += rng.expovariate(1.0 / mean_interarrival_s)
        blocks = rng.choices(prefixes, weights)[0] + tuple(next_id() for _ in range(rng.randint(1, 8)))
        requests.append(TraceRequest(now, len(blocks) * block_size - rng.randrange(block_size),
                                     rng.randint(16, 512), blocks))  # fmt: skip
    return requests


@dataclass(frozen=True)
class SimConfig:
    """The simulated cluster (flags of the same names)."""

    num_workers: int = 16
    cache_blocks: int = 2048
    """LRU capacity of one worker, in blocks (2048 x 512 tokens = 1M tokens: an H200's KV for an 8B model)."""
    block_size: int = 512
    prefill_tokens_per_s: float = 20_000.0
    decode_step_s: float = 0.02
    max_running: int = 256
    """The router's --max-running-per-worker: a worker's load is in_flight / max_running."""
    time_scale: float = 1.0
    """Multiplies inter-arrival times (< 1 = a faster, more loaded replay)."""


class LRUBlockCache:
    """One worker's block cache: LRU over block hashes; a request's blocks are touched last-to-first,
    so its tail is evicted before its prefix (as the engines' free queue does)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[Hashable, None] = OrderedDict()

    def __contains__(self, block_hash: Hashable) -> bool:
        return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def prefix_len(self, block_hashes: Sequence[Hashable]) -> int:
        n = 0
        for block_hash in block_hashes:
            if block_hash not in self._blocks:
                break
            n += 1
        return n

    def insert(self, block_hashes: Sequence[Hashable]) -> tuple[list[Hashable], list[Hashable]]:
        """Touches/stores the request's blocks; returns (stored, evicted) for the KV events."""
        stored = []
        blocks = self._blocks
        for block_hash in reversed(block_hashes):
            if block_hash in blocks:
                blocks.move_to_end(block_hash)
            else:
                blocks[block_hash] = None
                stored.append(block_hash)
        evicted = []
        while len(blocks) > self.capacity:
            evicted.append(blocks.popitem(last=False)[0])
        return stored, evicted


@dataclass
class PolicyResult:
    policy: str
    num_requests: int = 0
    total_blocks: int = 0
    cached_blocks: int = 0
    oracle_blocks: int = 0
    ideal_blocks: int = 0
    requests_per_worker: dict[str, int] = field(default_factory=dict)
    peak_in_flight: int = 0
    latencies_ms: list[float] = field(default_factory=list)

    def figures(self) -> dict[str, float | int | None]:
        counts = list(self.requests_per_worker.values())
        mean = statistics.fmean(counts) if counts else 0.0
        lat = sorted(self.latencies_ms)
        frac = self.cached_blocks / self.total_blocks if self.total_blocks else 0.0
        oracle = self.oracle_blocks / self.total_blocks if self.total_blocks else 0.0
        return {
            "cached_fraction": round(frac, 4),
            "oracle_fraction": round(oracle, 4),
            "ratio_to_oracle": round(frac / oracle, 4) if oracle else None,
            "ideal_fraction": round(self.ideal_blocks / self.total_blocks, 4) if self.total_blocks else 0.0,
            "load_imbalance": round(max(counts) / mean, 3) if mean else None,
            "peak_in_flight": self.peak_in_flight,
            "decision_p50_ms": round(lat[len(lat) // 2], 4) if lat else None,
            "decision_p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 4) if lat else None,
        }


def _ideal_blocks(requests: Iterable[TraceRequest]) -> list[int]:
    """Per request: leading blocks already seen earlier in the trace (one infinite cache)."""
    seen: set[Hashable] = set()
    out = []
    for r in requests:
        n = 0
        for h in r.block_hashes:
            if h not in seen:
                break
            n += 1
        out.append(n)
        seen.update(r.block_hashes)
    return out


def simulate(
    requests: Sequence[TraceRequest],
    policy: str,
    sim: SimConfig,
    alpha: float = 0.5,
    *,
    time_decisions: bool = True,
) -> PolicyResult:
    """Replays `requests` with `policy` over `sim.num_workers` simulated workers."""
    if policy not in BENCH_POLICIES:
        raise ValueError(f"policy must be one of {BENCH_POLICIES}, got {policy!r}")
    config = PolicyConfig(policy=policy if policy != ROUND_ROBIN else "load_balanced", routing_alpha=alpha)
    view = ClusterView(sim.block_size, max_running_per_worker=sim.max_running)
    worker_ids = [f"w{n:03d}" for n in range(sim.num_workers)]
    view.set_workers({w: WorkerEndpoint(w, f"sim:{n}", Role.PREFILL, kv_block_size=sim.block_size)
                      for n, w in enumerate(worker_ids)})  # fmt: skip
    caches = {w: LRUBlockCache(sim.cache_blocks) for w in worker_ids}
    in_flight: list[tuple[float, int, object]] = []  # (end time, seq, the LoadTracker.track context)
    result = PolicyResult(policy, requests_per_worker=dict.fromkeys(worker_ids, 0))
    ideal = _ideal_blocks(requests)
    clock = time.perf_counter
    for seq, request in enumerate(requests):
        now = request.arrival_s * sim.time_scale
        while in_flight and in_flight[0][0] <= now:
            heapq.heappop(in_flight)[2].__exit__(None, None, None)
        hashes = request.block_hashes
        prompt_len = max(request.input_length, len(hashes) * sim.block_size, 1)
        started = clock()
        snapshot = view.snapshot(hashes, prompt_len)
        if policy == ROUND_ROBIN:
            chosen_id = worker_ids[seq % len(worker_ids)]
        else:
            chosen = choose_prefill(snapshot, config)
            chosen_id = (
                chosen.worker_id
                if chosen is not None
                else min(worker_ids, key=lambda w: view.load.num_running(w))
            )  # all full: least loaded anyway
        if time_decisions:
            result.latencies_ms.append((clock() - started) * 1e3)
        depths = {w.worker_id: w.num_prefix_blocks for w in snapshot.prefill}
        cached = depths[chosen_id]
        assert cached == caches[chosen_id].prefix_len(hashes)
        result.num_requests += 1
        result.total_blocks += len(hashes)
        result.cached_blocks += cached
        result.oracle_blocks += max(depths.values(), default=0)
        result.ideal_blocks += ideal[seq]
        result.requests_per_worker[chosen_id] += 1
        stored, evicted = caches[chosen_id].insert(hashes)
        view.index.remove(chosen_id, evicted)  # what BlockRemoved / BlockStored would tell the router
        view.index.store(chosen_id, stored)
        uncached_tokens = max(0, request.input_length - cached * sim.block_size)
        service_s = uncached_tokens / sim.prefill_tokens_per_s + request.output_length * sim.decode_step_s
        tracker = view.load.track(chosen_id)
        tracker.__enter__()
        heapq.heappush(in_flight, (now + service_s, seq, tracker))
        result.peak_in_flight = max(result.peak_in_flight, view.load.num_in_flight(chosen_id))
    return result


def run_bench(
    requests: Sequence[TraceRequest],
    policies: Sequence[str],
    sim: SimConfig,
    alpha: float,
    latency_workers: int,
) -> dict[str, dict]:
    """policy -> figures; the decision latency comes from a second replay with `latency_workers` workers."""
    out = {}
    for policy in policies:
        result = simulate(requests, policy, sim, alpha, time_decisions=latency_workers == sim.num_workers)
        if latency_workers != sim.num_workers:
            timed = simulate(requests, policy, _replace(sim, num_workers=latency_workers), alpha)
            result.latencies_ms = timed.latencies_ms
        out[policy] = result.figures()
    return out


def _replace(sim: SimConfig, **changes) -> SimConfig:
    import dataclasses

    return dataclasses.replace(sim, **changes)
