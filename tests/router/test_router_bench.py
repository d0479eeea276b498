"""`splitserve bench router`'s core on a hand-checkable trace: exact cached / oracle block counts."""

import json

from splitserve.cli import main as cli_main
from splitserve.router.bench import LRUBlockCache, SimConfig, TraceRequest, load_trace, simulate
from splitserve.router.cluster_view import _tiebreak

# 2 workers, 3-block LRU caches, 4-token blocks; everything arrives at t=0 and runs long,
# so in-flight counts only grow.
SIM = SimConfig(num_workers=2, cache_blocks=3, block_size=4, prefill_tokens_per_s=1.0, decode_step_s=1.0)
HASHES = [(1, 2), (1, 2, 3), (5, 6), (1, 2, 4), (1, 2, 3)]
TRACE = [TraceRequest(0.0, 4 * len(h), 1, h) for h in HASHES]
# Equally loaded workers are ordered by a hash of (first block, worker id): the idle
# worker the first prefix (block 1) prefers, and the other one.
PREF = min(("w000", "w001"), key=lambda w: _tiebreak(1, w))
OTHER = "w001" if PREF == "w000" else "w000"


def test_lru_touches_a_request_tail_first_so_its_prefix_outlives_its_tail():
    cache = LRUBlockCache(3)
    assert cache.insert((1, 2, 3)) == ([3, 2, 1], [])
    assert cache.insert((1, 2, 4)) == ([4], [3])  # 3 was the least recently used
    assert cache.prefix_len((1, 2, 3)) == 2 and len(cache) == 3


def test_longest_prefix_exact_counts():
    # r0 -> PREF (all idle: the hash tie-break), r1 -> PREF (2 cached), r2 -> OTHER (no holder,
    # PREF busy), r3 -> PREF (2 cached; evicts 3), r4 -> PREF (2 cached: 1, 2 but not 3).
    f = simulate(TRACE, "longest_prefix", SIM, time_decisions=False)
    assert (f.total_blocks, f.cached_blocks, f.oracle_blocks, f.ideal_blocks) == (13, 6, 6, 7)
    assert f.requests_per_worker == {PREF: 4, OTHER: 1}
    figures = f.figures()
    assert figures["ratio_to_oracle"] == 1.0 and figures["load_imbalance"] == 1.6


def test_round_robin_exact_counts_against_the_oracle_on_its_own_caches():
    # r0 w000 (0), r1 w001 (0; w000 holds 2), r2 w000 (0; evicts 2 there), r3 w001 (2), r4 w000 (1; w001 holds 2).
    f = simulate(TRACE, "round_robin", SIM, time_decisions=False)
    assert (f.cached_blocks, f.oracle_blocks) == (3, 6)
    assert f.requests_per_worker == {"w000": 3, "w001": 2}


def test_scored_alpha_zero_is_load_only_and_alpha_one_follows_the_cache():
    by_load = simulate(TRACE, "scored", SIM, alpha=0.0, time_decisions=False)
    # Load only: each request goes to the less loaded worker, so the split stays 3 / 2.
    assert sorted(by_load.requests_per_worker.values()) == [2, 3]
    by_cache = simulate(TRACE, "scored", SIM, alpha=1.0, time_decisions=False)
    assert by_cache.cached_blocks == 6


def test_cli_json_and_missing_trace(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": 0, "input_length": 4 * len(h), "output_length": 1, "hash_ids": list(h)})
            + "\n"
            for h in HASHES
        )
    )
    assert [r.block_hashes for r in load_trace(trace)] == HASHES
    argv = [
        "bench",
        "router",
        "--trace",
        str(trace),
        "--workers",
        "2",
        "--latency-workers",
        "2",
        "--json",
        "--policy",
        "longest_prefix",
        "--policy",
        "round_robin",
    ]
    assert cli_main(argv) == 0
    figures = json.loads(capsys.readouterr().out)
    assert set(figures) == {"longest_prefix", "round_robin"}
    assert set(figures["longest_prefix"]) >= {
        "cached_fraction",
        "oracle_fraction",
        "ratio_to_oracle",
        "load_imbalance",
        "decision_p50_ms",
        "decision_p99_ms",
    }
    assert cli_main(["bench", "router", "--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err


def test_without_a_trace_file_the_bench_replays_a_seeded_synthetic_trace(monkeypatch, capsys):
    """Off this repository's checkout (no ../shared trace) the default still runs, offline, on a
    synthetic trace whose shared prefixes reward prefix-aware routing."""
    import splitserve.router.bench_cli as bench_cli
    from splitserve.router.bench import synthetic_trace

    trace = synthetic_trace(400, seed=3)
    assert trace == synthetic_trace(400, seed=3) and trace != synthetic_trace(400, seed=4)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(trace, trace[1:], strict=False))
    seen: dict = {}  # chained ids: an id names its whole prefix, so it always follows the same one
    for r in trace:
        assert 0 < r.input_length <= 512 * len(r.block_hashes)
        for i, block in enumerate(r.block_hashes):
            assert seen.setdefault(block, r.block_hashes[:i]) == r.block_hashes[:i]
    monkeypatch.setattr(bench_cli, "DEFAULT_TRACE", bench_cli.Path("/nonexistent/trace.jsonl"))
    argv = ["bench", "router", "--limit", "300", "--workers", "8", "--latency-workers", "4", "--json",
            "--policy", "longest_prefix", "--policy", "round_robin"]  # fmt: skip
    assert cli_main(argv) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["longest_prefix"]["cached_fraction"] > figures["round_robin"]["cached_fraction"] + 0.1
    assert figures["longest_prefix"]["ratio_to_oracle"] == 1.0
