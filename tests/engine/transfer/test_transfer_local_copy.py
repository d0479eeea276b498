"""`local_copy.copy_op` on CPU: every path (numpy pieces for head slices, torch slices for whole
heads, gather + scatter for scattered blocks) writes exactly the plan's bytes — bitwise what the
plan says the destination holds, and what the region-by-region in-process transport writes."""

from __future__ import annotations

import pytest
import torch
from kvtransfer_helpers import SENTINEL, assert_pools_equal, block_tables, layout, random_logical, scatter

from splitserve.engine.transfer import local_copy
from splitserve.engine.transfer.inproc import InProcTransport
from splitserve.engine.transfer.plan import build_plan

POOL = 40
NUM_BLOCKS = 12
FIRST_BLOCK = 1

# (src (tp, pp), dst (tp, pp)) with 8 kv heads: half / quarter / all heads, offsets on either side.
PAIRS = [((1, 1), (2, 1)), ((1, 1), (4, 2)), ((2, 1), (4, 1)), ((2, 2), (1, 1)), ((4, 1), (2, 2)), ((1, 1), (1, 2))]


def _copy_all(plan, src_kv, dst_kv) -> None:
    for op in plan.ops:
        local_copy.copy_op(op, src_kv[op.src_rank], dst_kv[op.dst_rank])


def _expected(logical, dst_lay, dst_tables):
    expected = logical.clone()
    expected[:, :, :FIRST_BLOCK] = SENTINEL
    return scatter(expected, dst_lay, dst_tables, POOL)


def _inproc(plan, src_kv, dst_kv) -> None:
    with InProcTransport() as src_t, InProcTransport() as dst_t:
        remote = {rank: src_t.expose(kv) for rank, kv in src_kv.items()}
        for rank, kv in dst_kv.items():
            dst_t.pull(plan, rank, remote, kv)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float8_e4m3fn"])
@pytest.mark.parametrize("contiguous", [True, False], ids=["block-runs", "scattered-blocks"])
@pytest.mark.parametrize(("src_shape", "dst_shape"), PAIRS, ids=[f"{s}->{d}" for s, d in PAIRS])
def test_copy_op_writes_the_plans_bytes(monkeypatch, src_shape, dst_shape, contiguous, dtype):
    src_lay = layout(*src_shape, 8, num_layers=4, head_dim=8, dtype=dtype)
    dst_lay = layout(*dst_shape, 8, num_layers=4, head_dim=8, dtype=dtype)
    logical = random_logical(src_lay, NUM_BLOCKS, seed=7)
    src_tables = block_tables(src_lay, NUM_BLOCKS, POOL, seed=1, contiguous=contiguous)
    dst_tables = block_tables(dst_lay, NUM_BLOCKS, POOL, seed=2, contiguous=contiguous)
    plan = build_plan(src_lay, dst_lay, src_tables, dst_tables, FIRST_BLOCK)
    src_kv = scatter(logical, src_lay, src_tables, POOL)
    blank = torch.full_like(logical, SENTINEL)
    dst_kv, reference = scatter(blank, dst_lay, dst_tables, POOL), scatter(blank, dst_lay, dst_tables, POOL)

    host_calls = []
    real = local_copy._copy_runs_host
    monkeypatch.setattr(local_copy, "_copy_runs_host", lambda *a: host_calls.append(a[0]) or real(*a))
    _copy_all(plan, src_kv, dst_kv)
    _inproc(plan, src_kv, reference)

    what = f"{src_lay.describe()} -> {dst_lay.describe()} {'runs' if contiguous else 'scattered'}"
    assert_pools_equal(dst_kv, _expected(logical, dst_lay, dst_tables), what)
    assert_pools_equal(dst_kv, reference, what + " vs in-process regions")
    head_sliced = [op for op in plan.ops if op.num_heads < max(src_lay.num_local_heads, dst_lay.num_local_heads)]
    if contiguous:  # few runs: head slices take the numpy path, whole heads do not
        assert host_calls == head_sliced, what


def test_numpy_and_torch_run_copies_agree_bitwise():
    """The two few-run paths on one head-sliced op with head offsets on both sides and two runs."""
    src_lay, dst_lay = layout(2, 1, 8, head_dim=8, dtype="bfloat16"), layout(4, 1, 8, head_dim=8, dtype="bfloat16")
    logical = random_logical(src_lay, 6, seed=3)
    src_tables = {0: [0, 1, 2, 7, 8, 9], 1: [3, 4, 5, 10, 11, 12]}
    dst_tables = {r: [20, 21, 22, 30, 31, 32] for r in range(4)}
    plan = build_plan(src_lay, dst_lay, src_tables, dst_tables)
    src_kv = scatter(logical, src_lay, src_tables, POOL)
    for op in plan.ops:
        assert len(op.block_runs) == 2
        out = {}
        for name, fn in (("host", local_copy._copy_runs_host), ("torch", local_copy._copy_runs_torch)):
            dst = [torch.full(dst_lay.kv_shape(POOL), SENTINEL, dtype=torch.bfloat16) for _ in range(3)]
            sh = slice(op.src_head_start, op.src_head_start + op.num_heads)
            dh = slice(op.dst_head_start, op.dst_head_start + op.num_heads)
            fn(op, src_kv[op.src_rank], dst, sh, dh)
            out[name] = {0: dst}
        assert_pools_equal(out["host"], out["torch"], f"op {op}")
