"""Exact plan contents: grouping keeps ops and regions few, replicas are read once and spread,
and wrong inputs are refused with messages that name the bad values."""

from __future__ import annotations

import pytest
import torch
from kvtransfer_helpers import layout

from splitserve.engine.transfer.inproc import InProcTransport
from splitserve.engine.transfer.plan import BlockRun, TransferOp, build_plan
from splitserve.engine.transfer.regions import ops_regions


def _tables(lay, ids):
    return {rank: list(ids) for rank in range(lay.world_size)}


def _summary(plan):
    return [(op.src_rank, op.dst_rank, op.layer_start, op.num_layers, op.src_head_start, op.dst_head_start,
             op.num_heads) for op in plan.ops]


def test_same_layout_is_one_op_per_rank_and_two_regions_per_layer():
    lay = layout(2, 2, 4, num_layers=4)
    plan = build_plan(lay, lay, _tables(lay, range(10, 16)), _tables(lay, range(3, 9)))
    assert _summary(plan) == [(0, 0, 0, 2, 0, 0, 2), (1, 1, 0, 2, 0, 0, 2),
                              (2, 2, 2, 2, 0, 0, 2), (3, 3, 2, 2, 0, 0, 2)]
    assert all(op.block_runs == (BlockRun(10, 3, 6),) for op in plan.ops)
    assert plan.ops[2].src_layer_start == 0 and plan.ops[2].dst_layer_start == 0
    regions = ops_regions(plan.ops, lay, lay, 16, 16)
    assert len(regions) == 4 * 2 * 2  # 4 ops × 2 local layers × {K, V}: whole runs coalesce
    assert regions.bytes_total == plan.bytes_total


def test_tp_shrink_and_grow_group_heads():
    tp4, tp1 = layout(4, 1, 8), layout(1, 1, 8)
    shrink = build_plan(tp4, tp1, _tables(tp4, range(4)), _tables(tp1, range(4)))
    assert _summary(shrink) == [(r, 0, 0, 3, 0, 2 * r, 2) for r in range(4)]
    grow = build_plan(tp1, tp4, _tables(tp1, range(4)), _tables(tp4, range(4)))
    assert _summary(grow) == [(0, r, 0, 3, 2 * r, 0, 2) for r in range(4)]
    # the per-pull lookups (worked out once per plan) agree with the ops
    for plan in (shrink, grow):
        for dst in range(4):
            mine = [op for op in plan.ops if op.dst_rank == dst]
            assert plan.sources_for(dst) == tuple(sorted({op.src_rank for op in mine}))
            for src in range(4):
                assert plan.pair_bytes(src, dst) == sum(
                    plan.op_bytes(op) for op in mine if op.src_rank == src)
    assert shrink.sources_for(0) == (0, 1, 2, 3) and shrink.sources_for(1) == () and shrink.pair_bytes(0, 1) == 0
    # A head slice on one side: one region per (layer, K|V, block).
    assert len(ops_regions(shrink.ops, tp4, tp1, 4, 4)) == 4 * 3 * 2 * 4


def test_replicated_source_heads_are_read_once_per_destination_rank_and_spread():
    tp4_kv2, tp1, tp4_kv1, tp2_kv1 = layout(4, 1, 2), layout(1, 1, 2), layout(4, 1, 1), layout(2, 1, 1)
    # dst tp1 needs heads 0 (on src ranks 0,1) and 1 (on 2,3): once each.
    assert _summary(build_plan(tp4_kv2, tp1, _tables(tp4_kv2, [0]), _tables(tp1, [0]))) == [
        (0, 0, 0, 3, 0, 0, 1), (2, 0, 0, 3, 0, 1, 1)]
    # Same layout with replicas: each dst rank reads its own replica, not all from the first.
    assert [(op.src_rank, op.dst_rank) for op in
            build_plan(tp4_kv2, tp4_kv2, _tables(tp4_kv2, [0]), _tables(tp4_kv2, [0])).ops] == [
        (0, 0), (1, 1), (2, 2), (3, 3)]
    assert [(op.src_rank, op.dst_rank) for op in
            build_plan(tp4_kv1, tp2_kv1, _tables(tp4_kv1, [0]), _tables(tp2_kv1, [0])).ops] == [(0, 0), (1, 1)]
    # Replicated destination: every replica gets its own copy, from the single source.
    grow = build_plan(tp1, tp4_kv2, _tables(tp1, [0]), _tables(tp4_kv2, [0]))
    assert _summary(grow) == [(0, r, 0, 3, r // 2, 0, 1) for r in range(4)]


def test_pp_mismatch_splits_ops_at_stage_boundaries():
    src = layout(1, 2, 2, num_layers=5, layer_ranges=((0, 1), (1, 5)))
    dst = layout(2, 2, 2, num_layers=5)  # (0, 3), (3, 5)
    plan = build_plan(src, dst, _tables(src, [7]), _tables(dst, [1]))
    assert [(op.src_rank, op.dst_rank, op.layer_start, op.num_layers, op.src_layer_start, op.dst_layer_start,
             op.src_head_start, op.dst_head_start) for op in plan.ops] == [
        (0, 0, 0, 1, 0, 0, 0, 0), (1, 0, 1, 2, 0, 1, 0, 0),
        (0, 1, 0, 1, 0, 0, 1, 0), (1, 1, 1, 2, 0, 1, 1, 0),
        (1, 2, 3, 2, 2, 0, 0, 0), (1, 3, 3, 2, 2, 0, 1, 0),
    ]
    assert plan.bytes_by_pair() == {(0, 0): 1 * 2 * 32, (1, 0): 2 * 2 * 32, (0, 1): 64, (1, 1): 128,
                                    (1, 2): 128, (1, 3): 128}
    assert "src rank 1 -> dst rank 2: 1 ops 128 bytes" in plan.summary()


def test_block_runs_split_only_where_either_side_jumps():
    lay = layout(1, 1, 1)
    plan = build_plan(lay, lay, {0: [4, 5, 6, 9, 10, 2]}, {0: [0, 1, 7, 8, 9, 3, 99]}, first_block=1)
    assert plan.ops[0].block_runs == (BlockRun(5, 1, 1), BlockRun(6, 7, 1), BlockRun(9, 8, 2),
                                      BlockRun(2, 3, 1))
    assert plan.num_blocks == 6 and plan.bytes_total == 3 * 2 * 5 * lay.head_block_bytes


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(dst=layout(1, 1, 2, num_layers=4)), "num_layers: src=3 dst=4"),
    (dict(dst=layout(1, 1, 4)), "num_kv_heads: src=2 dst=4"),
    (dict(dst=layout(1, 1, 2, dtype="bfloat16")), "dtype: src='float32' dst='bfloat16'"),
    (dict(dst=layout(1, 1, 2, block_size=4)), "block_size differs: src=2 dst=4; re-blocking"),
    (dict(src_ids={0: [1, 2]}), r"src_block_ids has ranks \[0\], expected exactly 0..1"),
    (dict(src_ids={0: [1, 2], 1: [3]}), r"src_block_ids lengths differ across ranks: \{0: 2, 1: 1\}"),
    (dict(dst_ids={0: [1]}), r"dst_block_ids too short for the request's 2 blocks: lengths \{0: 1\}"),
    (dict(dst_ids={0: [1, 1]}), r"dst_block_ids\[0\] repeats a block id: \[1, 1\]"),
    (dict(src_ids={0: [1, -2], 1: [0, 1]}), r"src_block_ids\[0\] must be non-negative ints"),
    (dict(first_block=3), r"first_block 3 out of range \[0, 2\]"),
])
def test_bad_plan_inputs_are_refused_clearly(kwargs, message):
    src = layout(2, 1, 2)
    dst = kwargs.get("dst", layout(1, 1, 2))
    src_ids = kwargs.get("src_ids", {0: [0, 1], 1: [2, 3]})
    dst_ids = kwargs.get("dst_ids", {r: [4, 5] for r in range(dst.world_size)})
    with pytest.raises(ValueError, match=message):
        build_plan(src, dst, src_ids, dst_ids, kwargs.get("first_block", 0))


def test_bad_ops_regions_and_tensors_are_refused():
    with pytest.raises(ValueError, match="num_heads=0"):
        TransferOp(0, 0, 0, 1, 0, 0, 0, 0, 0, (BlockRun(0, 0, 1),))
    lay = layout(1, 1, 2)
    plan = build_plan(lay, lay, {0: [8]}, {0: [0]})
    with pytest.raises(ValueError, match="src block id 8 out of range for a pool of 8 blocks"):
        ops_regions(plan.ops, lay, lay, 8, 8)
    good = [torch.zeros(lay.kv_shape(9)) for _ in range(3)]
    with InProcTransport() as t:
        remote = {0: t.expose(good)}
        with pytest.raises(ValueError, match="no endpoint metadata for source ranks"):
            t.pull(plan, 0, {}, good)
        with pytest.raises(ValueError, match=r"rank 0 has 2 KV tensors, its stage holds 3 layers"):
            t.pull(plan, 0, remote, good[:2])
        with pytest.raises(ValueError, match=r"shape \(2, 9, 1, 2, 4\), expected \(2, 9, 2, 2, 4\)"):
            t.pull(plan, 0, remote, [torch.zeros(2, 9, 1, 2, 4)] * 3)
        with pytest.raises(ValueError, match="dtype torch.float16, layout says float32"):
            t.pull(plan, 0, remote, [g.half() for g in good])
        with pytest.raises(ValueError, match=r"rank 1 out of range \[0, 1\)"):
            t.pull(plan, 1, remote, good)
