"""Every policy on hand-built snapshots: exact choices, ties, extremes, empty pools, conditional disaggregation."""

from __future__ import annotations

import pytest

from splitserve.router.policy import (
    DisaggRequiredError,
    NoWorkersError,
    OverloadedError,
    PolicyConfig,
    choose_decode,
    choose_prefill,
    first_prefix_block,
    load_balanced,
    longest_prefix,
    route,
    scored,
)
from splitserve.router.snapshot import RoutingDecision, Snapshot, WorkerState


def w(worker_id: str, prefix: int = 0, running: int = 0, kv: float | None = None) -> WorkerState:
    return WorkerState(worker_id, num_prefix_blocks=prefix, num_running=running, max_running=10, kv_usage=kv)


def ids(worker: WorkerState | None) -> str | None:
    return None if worker is None else worker.worker_id


def test_load_balanced_least_loaded_then_running_then_id():
    assert ids(load_balanced([w("p0", running=3), w("p2", running=1), w("p1", running=1)])) == "p1"
    # Reported KV usage counts as load: 0.9 beats 2 of 10 requests.
    assert ids(load_balanced([w("p0", running=0, kv=0.9), w("p1", running=2)])) == "p1"
    # Same load (0.5 either way): fewer running requests wins.
    assert ids(load_balanced([w("p0", running=5), w("p1", running=1, kv=0.5)])) == "p1"
    assert load_balanced([]) is None


def test_longest_prefix_ties_go_to_the_least_loaded():
    workers = [w("p0", prefix=2, running=5), w("p1", prefix=3, running=9), w("p2", prefix=3, running=1)]
    assert ids(longest_prefix(workers)) == "p2"
    assert ids(longest_prefix([w("p1", prefix=0), w("p0", prefix=0)])) == "p0"
    assert longest_prefix([]) is None


def test_first_prefix_block_sticks_to_holders_else_balances():
    workers = [w("p0", prefix=0, running=0), w("p1", prefix=1, running=5), w("p2", prefix=4, running=6)]
    assert ids(first_prefix_block(workers)) == "p1"  # least loaded holder, not the longest prefix
    assert ids(first_prefix_block([w("p0", running=2), w("p1", running=1)])) == "p1"  # no holder
    assert first_prefix_block([]) is None


def test_scored_alpha_extremes_and_the_middle():
    cached_busy, idle_cold = w("p0", prefix=4, running=9), w("p1", prefix=0, running=0)
    assert ids(scored([cached_busy, idle_cold], num_blocks=4, alpha=1.0)) == "p0"  # pure affinity
    assert ids(scored([cached_busy, idle_cold], num_blocks=4, alpha=0.0)) == "p1"  # pure load
    # 0.5 * 1.0 + 0.5 * 0.1 = 0.55 > 0.5 * 0 + 0.5 * 1.0 = 0.5
    assert ids(scored([cached_busy, idle_cold], num_blocks=4, alpha=0.5)) == "p0"
    # 0.5 * 0.5 + 0.5 * 0.1 = 0.30 < 0.50
    assert ids(scored([w("p0", prefix=2, running=9), idle_cold], num_blocks=4, alpha=0.5)) == "p1"


def test_scored_ties():
    # alpha 0, equal load: the longer prefix breaks the tie.
    assert ids(scored([w("p0", prefix=1, running=2), w("p1", prefix=3, running=2)], 4, 0.0)) == "p1"
    # alpha 1, equal prefix: the less loaded one.
    assert ids(scored([w("p0", prefix=2, running=4), w("p1", prefix=2, running=3)], 4, 1.0)) == "p1"
    # Everything equal: the lower id.
    assert ids(scored([w("p1", prefix=2), w("p0", prefix=2)], 4, 0.5)) == "p0"
    # A prompt shorter than a block matches nothing: load decides.
    assert ids(scored([w("p0", running=3), w("p1", running=2)], 0, 1.0)) == "p1"
    assert scored([], 4, 0.5) is None


def test_choose_prefill_dispatches_and_skips_full_workers():
    snapshot = Snapshot(16, 4, prefill=(w("p0", prefix=4, running=10), w("p1", prefix=1, running=3), w("p2")))
    assert ids(choose_prefill(snapshot, PolicyConfig(policy="longest_prefix"))) == "p1"  # p0 is full
    assert ids(choose_prefill(snapshot, PolicyConfig(policy="load_balanced"))) == "p2"
    assert ids(choose_prefill(snapshot, PolicyConfig(policy="first_prefix_block"))) == "p1"
    assert ids(choose_prefill(snapshot, PolicyConfig(policy="scored", routing_alpha=0.0))) == "p2"
    full = Snapshot(16, 4, prefill=(w("p0", running=10),))
    assert choose_prefill(full, PolicyConfig()) is None


def test_decode_choice_weighs_load_against_transfer_bytes():
    # 16 tokens / 4 = 4 KV blocks. d0 idle but caches nothing; d1 busier but caches all.
    snapshot = Snapshot(16, 4, decode=(w("d0", prefix=0, running=0), w("d1", prefix=4, running=3)))
    assert ids(choose_decode(snapshot, transfer_weight=0.5)) == "d1"  # 0.15 < 0.5
    assert ids(choose_decode(snapshot, transfer_weight=0.0)) == "d0"  # load only
    assert ids(choose_decode(snapshot, transfer_weight=1.0)) == "d1"  # bytes only
    # Equal cost: the one already holding more of the prefix.
    tie = Snapshot(16, 4, decode=(w("d0", prefix=0, running=5), w("d1", prefix=2, running=5)))
    assert ids(choose_decode(tie, transfer_weight=0.0)) == "d1"
    assert choose_decode(Snapshot(16, 4, decode=(w("d0", running=10),)), 0.5) is None


def test_route_disaggregated_decision_is_exact():
    # 18 tokens, block 4: 4 full blocks, 5 KV blocks (the last one partial).
    snapshot = Snapshot(18, 4, prefill=(w("p0", prefix=3, running=1), w("p1")), decode=(w("d0", prefix=1), w("d1")))
    config = PolicyConfig(policy="longest_prefix", transfer_weight=0.5, kv_bytes_per_block=1000)
    decision = route(snapshot, config)
    assert decision == RoutingDecision(
        prefill_worker_id="p0", decode_worker_id="d0", num_predicted_cached_tokens=12,
        reason=decision.reason, num_transfer_blocks=4, num_transfer_bytes=4000,
    )  # fmt: skip
    assert decision.is_disaggregated
    assert "longest_prefix picked prefill p0" in decision.reason and "moves 4 blocks" in decision.reason


def test_route_empty_pools():
    with pytest.raises(NoWorkersError, match="no routable decode worker"):
        route(Snapshot(8, 4, prefill=(w("p0"),)), PolicyConfig())
    aggregated = route(Snapshot(8, 4, decode=(w("d0", prefix=1),)), PolicyConfig())
    assert aggregated.prefill_worker_id is None and aggregated.decode_worker_id == "d0"
    assert aggregated.num_predicted_cached_tokens == 4 and aggregated.num_transfer_blocks == 0
    assert aggregated.reason.startswith("aggregated: no prefill worker")


def test_enforce_disagg_fails_clearly_and_the_request_flag_overrides():
    no_prefill = Snapshot(8, 4, decode=(w("d0"),))
    with pytest.raises(DisaggRequiredError, match="enforce_disagg is set but no prefill worker"):
        route(no_prefill, PolicyConfig(enforce_disagg=True))
    with pytest.raises(DisaggRequiredError):
        route(no_prefill, PolicyConfig(), enforce_disagg=True)
    assert route(no_prefill, PolicyConfig(enforce_disagg=True), enforce_disagg=False).prefill_worker_id is None


def test_conditional_disaggregation_threshold():
    # 18 tokens; d0 caches 4 blocks = 16 tokens: 2 uncached.
    snapshot = Snapshot(18, 4, prefill=(w("p0"),), decode=(w("d0", prefix=4),))
    short = route(snapshot, PolicyConfig(disagg_min_uncached_tokens=3))
    assert short.prefill_worker_id is None and short.num_predicted_cached_tokens == 16
    assert "2 uncached tokens < disagg_min_uncached_tokens=3" in short.reason
    assert route(snapshot, PolicyConfig(disagg_min_uncached_tokens=2)).prefill_worker_id == "p0"
    assert route(snapshot, PolicyConfig(disagg_min_uncached_tokens=0)).prefill_worker_id == "p0"
    # enforce_disagg wins over the threshold.
    assert route(snapshot, PolicyConfig(disagg_min_uncached_tokens=3, enforce_disagg=True)).prefill_worker_id == "p0"


def test_full_pools_are_overloaded():
    with pytest.raises(OverloadedError, match="all 1 decode workers are full"):
        route(Snapshot(8, 4, prefill=(w("p0"),), decode=(w("d0", running=10),)), PolicyConfig())
    with pytest.raises(OverloadedError, match="all 2 prefill workers are full"):
        route(Snapshot(8, 4, prefill=(w("p0", running=10), w("p1", running=10)), decode=(w("d0"),)), PolicyConfig())


def test_validation_quotes_the_bad_value():
    with pytest.raises(ValueError, match="1.5"):
        PolicyConfig(routing_alpha=1.5)
    with pytest.raises(ValueError, match="'round_robin'"):
        PolicyConfig(policy="round_robin")
    with pytest.raises(ValueError, match="-1"):
        PolicyConfig(disagg_min_uncached_tokens=-1)
    with pytest.raises(ValueError, match="caches 3 blocks of a prompt with 2 full blocks"):
        Snapshot(8, 4, prefill=(w("p0", prefix=3),))
    with pytest.raises(ValueError, match="unique"):
        Snapshot(8, 4, prefill=(w("x"),), decode=(w("x"),))
    with pytest.raises(ValueError, match="1.2"):
        WorkerState("p0", kv_usage=1.2)
