"""NIXL reshard pulls through staging buffers (engine/transfer/nixl_staging.py): whole source
blocks are read in few regions, the wanted heads cut out locally — exactly the bytes a strided
pull writes, with several chunks in flight (double buffering), and far fewer regions."""

from __future__ import annotations

import pytest
import torch
from kvtransfer_helpers import SENTINEL, assert_pools_equal, block_tables, layout, random_logical, scatter

from splitserve.engine.transfer import nixl_staging
from splitserve.engine.transfer.plan import build_plan

pytest.importorskip("nixl_cu13")


def _case(src_lay, dst_lay, num_blocks, contiguous, seed):
    logical = random_logical(src_lay, num_blocks, seed)
    src_t = block_tables(src_lay, num_blocks, 40, seed, contiguous)
    dst_t = block_tables(dst_lay, num_blocks, 40, seed + 1, contiguous)
    plan = build_plan(src_lay, dst_lay, src_t, dst_t, 1)
    expected = logical.clone()
    expected[:, :, :1] = SENTINEL
    dst_kv = scatter(torch.full_like(logical, SENTINEL), dst_lay, dst_t, 40)
    return plan, scatter(logical, src_lay, src_t, 40), dst_kv, scatter(expected, dst_lay, dst_t, 40)


@pytest.mark.parametrize("contiguous", [True, False], ids=["block-runs", "scattered-blocks"])
def test_staged_reshard_writes_exactly_what_a_strided_pull_does(monkeypatch, contiguous):
    from splitserve.engine.transfer.nixl_transport import NixlTransport

    monkeypatch.setattr(nixl_staging, "CHUNK_BYTES", 3 * 2 * 12 * 4 * 2 * 4 * 4)  # ~3 units: several chunks
    src_lay, dst_lay = layout(1, 1, 4, num_layers=4), layout(2, 2, 4, num_layers=4)  # each dst rank: half the heads
    plan, src_kv, dst_kv, expected = _case(src_lay, dst_lay, 12, contiguous, seed=11)
    assert all(nixl_staging.should_stage(op, src_lay) for op in plan.ops)
    strided = {r: [t.clone() for t in kv] for r, kv in dst_kv.items()}
    with NixlTransport() as src_t, NixlTransport() as staged_t, NixlTransport(stage_reshards=False) as plain_t:
        remote = {0: src_t.expose(src_kv[0])}
        for rank in range(dst_lay.world_size):
            staged = staged_t.pull(plan, rank, remote, dst_kv[rank])
            plain = plain_t.pull(plan, rank, remote, strided[rank])
            assert staged.num_bytes == plain.num_bytes == sum(plan.op_bytes(op) for op in plan.ops_for_dst(rank))
            if contiguous:  # one region per (layer, K|V) run instead of per (layer, K|V, block)
                assert staged.num_regions < plain.num_regions
    assert_pools_equal(dst_kv, expected, "staged tp1 -> tp2 pp2")
    assert_pools_equal(strided, expected, "strided tp1 -> tp2 pp2")


def test_only_ops_taking_at_least_half_the_heads_are_staged():
    src = layout(1, 1, 8)
    plan = build_plan(src, layout(2, 1, 8), {0: [0, 1]}, {0: [0, 1], 1: [2, 3]})
    assert all(nixl_staging.should_stage(op, src) for op in plan.ops)  # 4 of 8 heads
    plan = build_plan(src, layout(4, 1, 8), {0: [0, 1]}, {r: [0, 1] for r in range(4)})
    assert not any(nixl_staging.should_stage(op, src) for op in plan.ops)  # 2 of 8: 4x the bytes
    same = build_plan(src, src, {0: [0, 1]}, {0: [2, 3]})
    assert not nixl_staging.should_stage(same.ops[0], src)  # all heads: nothing to cut
