"""Every src → dst layout over {tp 1,2,4} × {pp 1,2} × kv heads {1,2,4,8}: build the plan, move the
KV with the in-process transport, and check the destination bitwise — transferred blocks equal the
source's logical KV on every rank (replicas included), cached prefix blocks and blocks outside the
request keep their sentinel."""

from __future__ import annotations

import itertools

import pytest
import torch
from kvtransfer_helpers import (
    SENTINEL,
    assert_pools_equal,
    assert_same_bits,
    block_tables,
    gather,
    layout,
    random_logical,
    scatter,
)

from splitserve.engine.transfer.checksum import unit_checksums, verify_unit_checksums
from splitserve.engine.transfer.inproc import InProcTransport
from splitserve.engine.transfer.plan import build_plan

SHAPES = [(tp, pp) for tp in (1, 2, 4) for pp in (1, 2)]
POOL = 9
NUM_BLOCKS = 5


def _transfer(src_lay, dst_lay, first_block, seed, contiguous=False, dst_extra=0):
    logical = random_logical(src_lay, NUM_BLOCKS, seed)
    src_tables = block_tables(src_lay, NUM_BLOCKS, POOL, seed, contiguous)
    dst_tables = block_tables(dst_lay, NUM_BLOCKS + dst_extra, POOL, seed + 1, contiguous)
    src_kv = scatter(logical, src_lay, src_tables, POOL)
    dst_kv = scatter(torch.full_like(logical, SENTINEL), dst_lay, dst_tables, POOL)
    plan = build_plan(src_lay, dst_lay, src_tables, dst_tables, first_block)
    with InProcTransport() as src_t, InProcTransport() as dst_t:
        remote = {rank: src_t.expose(src_kv[rank]) for rank in src_kv}
        total = 0
        for rank in range(dst_lay.world_size):
            stats = dst_t.pull(plan, rank, remote, dst_kv[rank])
            assert stats.num_bytes == sum(n for (s, d), n in plan.bytes_by_pair().items() if d == rank)
            total += stats.num_bytes
    assert total == plan.bytes_total
    return logical, plan, src_kv, src_tables, dst_kv, dst_tables


@pytest.mark.parametrize("kv_heads", [1, 2, 4, 8])
def test_every_layout_pair_moves_kv_exactly(kv_heads):
    for i, ((s_tp, s_pp), (d_tp, d_pp)) in enumerate(itertools.product(SHAPES, SHAPES)):
        src_lay, dst_lay = layout(s_tp, s_pp, kv_heads), layout(d_tp, d_pp, kv_heads)
        first_block = i % 3  # 0, 1, 2 cached blocks on the destination
        logical, plan, _, _, dst_kv, dst_tables = _transfer(src_lay, dst_lay, first_block, seed=i)
        what = f"{src_lay.describe()} -> {dst_lay.describe()} first_block={first_block}"
        expected_logical = logical.clone()
        expected_logical[:, :, :first_block] = SENTINEL
        # Every rank, replicas included; sentinel kept outside the transferred blocks.
        assert_pools_equal(dst_kv, scatter(expected_logical, dst_lay, dst_tables, POOL), what)
        assert_same_bits(gather(dst_kv, dst_lay, dst_tables, NUM_BLOCKS)[:, :, first_block:],
                         logical[:, :, first_block:], what)
        expected_bytes = (kv_heads * dst_lay.num_layers * 2 * (NUM_BLOCKS - first_block)
                          * src_lay.head_block_bytes * max(1, dst_lay.num_replicas))
        assert plan.bytes_total == expected_bytes, what


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_two_byte_dtypes_and_uneven_custom_layer_ranges(dtype):
    src_lay = layout(2, 2, 2, num_layers=5, dtype=dtype, layer_ranges=((0, 1), (1, 5)))
    dst_lay = layout(4, 2, 2, num_layers=5, dtype=dtype)  # default (0, 3), (3, 5)
    logical, _, _, _, dst_kv, dst_tables = _transfer(src_lay, dst_lay, 1, seed=3, dst_extra=2)
    expected = logical.clone()
    expected[:, :, :1] = SENTINEL
    assert_pools_equal(dst_kv, scatter(expected, dst_lay, dst_tables, POOL), "bf16 uneven pp")


def test_fully_cached_request_moves_nothing():
    src_lay, dst_lay = layout(2, 1, 4), layout(1, 2, 4)
    _, plan, _, _, dst_kv, dst_tables = _transfer(src_lay, dst_lay, NUM_BLOCKS, seed=5)
    assert plan.ops == () and plan.bytes_total == 0
    assert all((t == SENTINEL).all() for ts in dst_kv.values() for t in ts)


def test_checksums_match_across_layouts_and_catch_a_flipped_element():
    src_lay, dst_lay = layout(4, 1, 2), layout(1, 2, 2)
    first_block = 1
    _, _, src_kv, src_tables, dst_kv, dst_tables = _transfer(src_lay, dst_lay, first_block, seed=11)
    expected = {}
    for rank, kv in src_kv.items():
        units = unit_checksums(kv, src_lay, rank, src_tables[rank], first_block)
        assert not set(units) & set(expected), "replicated heads must be reported once"
        expected |= units
    assert len(expected) == src_lay.num_layers * src_lay.num_kv_heads
    for rank, kv in dst_kv.items():
        assert verify_unit_checksums(kv, dst_lay, rank, dst_tables[rank], expected, first_block) == []
    # One flipped element in one transferred block of dst rank 1 (global layers 2..3).
    kv = dst_kv[1]
    kv[0][1, dst_tables[1][3], 1, 0, 2] += 1.0
    bad = verify_unit_checksums(kv, dst_lay, 1, dst_tables[1], expected, first_block)
    assert bad == [(2, 1)]


_EXPOSE_AND_PRINT = """
import torch
from splitserve.engine.transfer.inproc import InProcTransport
print(InProcTransport().expose([torch.zeros(2, 9, 2, 2, 2, 4)]).decode())
"""


def test_a_token_of_another_process_fails_at_once_and_says_why():
    """Tokens name their process: with a bare counter, another process's first token was this
    process's own first token, so a decode worker started with `--transport inproc` read its own
    pool's progress board and waited out the stall timeout (30 s) for layers that never came."""
    import subprocess
    import sys
    import time

    from splitserve.engine.transfer.inproc import exposed
    from splitserve.engine.transfer.transport import TransferError

    foreign = subprocess.run([sys.executable, "-c", _EXPOSE_AND_PRINT], capture_output=True, text=True,
                             timeout=120, check=True).stdout.strip().encode()
    src_lay = dst_lay = layout(1, 1, 2)
    tables = block_tables(src_lay, NUM_BLOCKS, POOL, seed=1)
    plan = build_plan(src_lay, dst_lay, tables, tables, 0)
    with InProcTransport() as own, InProcTransport() as dst_t:
        mine = own.expose(scatter(random_logical(src_lay, NUM_BLOCKS, 1), src_lay, tables, POOL)[0])
        assert mine != foreign and exposed(mine)
        dst_kv = scatter(torch.zeros_like(random_logical(src_lay, NUM_BLOCKS, 1)), dst_lay, tables, POOL)[0]
        started = time.monotonic()
        with pytest.raises(TransferError, match="exposed by another process.*--transport nixl"):
            dst_t.pull(plan, 0, {0: foreign}, dst_kv, timeout_s=30)
        with pytest.raises(TransferError, match="another process"):
            dst_t.read_board(foreign, 0, 8)
        assert time.monotonic() - started < 5
    with pytest.raises(TransferError, match="is not exposed"):  # closed: its pool is gone
        exposed(mine)
