"""`PairGroups`: the per-peer cache of pair process groups (exact state), and `torch_dist`
send/recv over a group that `torch.distributed` does not know, between two real processes."""

from __future__ import annotations

import os
import time

import pytest
import torch
from kvtransfer_helpers import SENTINEL, _report, check_destination, handoff_case, run_processes, scatter

from splitserve.engine.transfer.pair_group import PairGroups, PairGroupSpec, create_pair_group
from splitserve.engine.transfer.transport import TransferTimeout

CPU = torch.device("cpu")


def _spec(tmp_path, key: str, rank: int = 0, world: int = 1) -> PairGroupSpec:
    return PairGroupSpec(key, str(tmp_path / key), rank, world, "gloo")


def test_a_group_is_reused_for_the_same_key_and_replaced_for_a_new_one(tmp_path):
    groups = PairGroups(max_groups=2)
    first = groups.get("decode-a", _spec(tmp_path, "k1"), CPU, 10)
    assert groups.get("decode-a", _spec(tmp_path, "k1"), CPU, 10) is first
    assert (groups.num_created, groups.key_for("decode-a"), len(groups)) == (1, "k1", 1)
    second = groups.get("decode-a", _spec(tmp_path, "k2"), CPU, 10)  # the peer started afresh
    assert second is not first
    assert (groups.num_created, groups.key_for("decode-a"), len(groups)) == (2, "k2", 1)
    assert not os.path.exists(tmp_path / "k1")  # rank 0 removes a dropped group's store file


def test_least_recently_used_group_is_evicted_and_drop_forgets(tmp_path):
    groups = PairGroups(max_groups=2)
    groups.get("a", _spec(tmp_path, "ka"), CPU, 10)
    groups.get("b", _spec(tmp_path, "kb"), CPU, 10)
    groups.get("a", _spec(tmp_path, "ka"), CPU, 10)  # a is now the most recent
    groups.get("c", _spec(tmp_path, "kc"), CPU, 10)
    assert [groups.key_for(p) for p in "abc"] == ["ka", None, "kc"]
    assert groups.num_created == 3
    groups.drop("a")
    groups.drop("never-seen")
    assert (len(groups), groups.key_for("a")) == (1, None)
    groups.close()
    assert len(groups) == 0


def test_joining_without_the_peers_times_out_and_leaves_no_store_file(tmp_path):
    spec = _spec(tmp_path, "lonely", rank=0, world=2)
    start = time.monotonic()
    with pytest.raises(TransferTimeout, match="joining pair group lonely as rank 0/2"):
        create_pair_group(spec, CPU, timeout_s=0.5)
    assert time.monotonic() - start < 5
    assert not os.path.exists(spec.store_path)


@pytest.mark.parametrize("bad", [
    dict(key=""), dict(rank=2), dict(rank=-1), dict(backend="mpi"),
])
def test_bad_specs_are_rejected(tmp_path, bad):
    fields = dict(key="k", store_path=str(tmp_path / "k"), rank=0, world_size=2, backend="gloo") | bad
    with pytest.raises(ValueError, match="pair group"):
        PairGroupSpec(**fields)


# tp 2 -> pp 2 between a "prefill" (pair ranks 0, 1) and a "decode" (pair ranks 2, 3) worker.
CASE = dict(src=dict(tp=2, pp=1, kv_heads=2), dst=dict(tp=1, pp=2, kv_heads=2), num_blocks=4, pool=8, seed=5,
            first_block=1)


def _pair_rank(pair_rank: int, store_path: str, results) -> None:
    """Two transfers over one pair group, built from a FileStore with no default group."""
    def body():
        import torch.distributed as dist

        from splitserve.engine.transfer.torch_dist import recv_plan, send_plan

        assert not dist.is_initialized()
        src_lay, dst_lay, logical, src_tables, dst_tables, plan = handoff_case(CASE)
        groups = PairGroups()
        spec = PairGroupSpec("k", store_path, pair_rank, src_lay.world_size + dst_lay.world_size, "gloo")
        for _ in range(2):
            group = groups.get("peer", spec, CPU, 30)
            if pair_rank < src_lay.world_size:
                kv = scatter(logical, src_lay, src_tables, CASE["pool"])[pair_rank]
                peers = {d: src_lay.world_size + d for d in range(dst_lay.world_size)}
                send_plan(plan, pair_rank, kv, peers, group, timeout_s=30)
            else:
                rank = pair_rank - src_lay.world_size
                kv = scatter(torch.full_like(logical, SENTINEL), dst_lay, dst_tables, CASE["pool"])[rank]
                recv_plan(plan, rank, kv, {s: s for s in range(src_lay.world_size)}, group, timeout_s=30)
                check_destination(CASE, rank, kv)
        assert groups.num_created == 1 and not dist.is_initialized()
        groups.close()
    _report(results, pair_rank, body)


def test_plans_travel_over_a_cached_pair_group_between_four_processes(tmp_path):
    run_processes([(_pair_rank, rank, str(tmp_path / "store")) for rank in range(4)])
