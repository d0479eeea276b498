"""pack_ops / unpack_ops against the byte regions the memory transports copy: both must produce
the same destination, for head slices, replicated heads and PP splits."""

from __future__ import annotations

import pytest
import torch
from kvtransfer_helpers import SENTINEL, assert_pools_equal, block_tables, layout, random_logical, scatter

from splitserve.engine.transfer.inproc import InProcTransport
from splitserve.engine.transfer.pack import pack_ops, packed_numel, unpack_ops
from splitserve.engine.transfer.plan import build_plan


@pytest.mark.parametrize(("src_shape", "dst_shape", "kv_heads"), [
    ((4, 1), (1, 2), 8), ((1, 2), (4, 1), 2), ((2, 2), (2, 1), 1), ((1, 1), (2, 2), 4),
])
def test_pack_unpack_matches_region_copies(src_shape, dst_shape, kv_heads):
    src, dst = layout(*src_shape, kv_heads), layout(*dst_shape, kv_heads)
    n, pool = 4, 7
    logical = random_logical(src, n, seed=4)
    src_t, dst_t = block_tables(src, n, pool, 5), block_tables(dst, n, pool, 6)
    plan = build_plan(src, dst, src_t, dst_t, first_block=1)
    src_kv = scatter(logical, src, src_t, pool)
    packed_kv = scatter(torch.full_like(logical, SENTINEL), dst, dst_t, pool)
    copied_kv = scatter(torch.full_like(logical, SENTINEL), dst, dst_t, pool)
    for (s, d) in plan.bytes_by_pair():
        ops = plan.ops_for_pair(s, d)
        buf = pack_ops(ops, src, src_kv[s])
        assert buf.numel() == packed_numel(ops, src) and buf.numel() * 4 == plan.bytes_by_pair()[(s, d)]
        unpack_ops(buf, ops, dst, packed_kv[d])
    with InProcTransport() as t:
        remote = {r: t.expose(kv) for r, kv in src_kv.items()}
        for d in range(dst.world_size):
            t.pull(plan, d, remote, copied_kv[d])
    assert_pools_equal(packed_kv, copied_kv, "pack vs regions")


def test_pack_buffer_shape_is_checked():
    lay = layout(1, 1, 2)
    plan = build_plan(lay, lay, {0: [0, 1]}, {0: [2, 3]})
    kv = [torch.zeros(lay.kv_shape(4)) for _ in range(3)]
    with pytest.raises(ValueError, match=r"unpack buffer is \(5,\) torch.float32, expected \(192,\)"):
        unpack_ops(torch.zeros(5), plan.ops, lay, kv)
    with pytest.raises(ValueError, match=r"pack buffer is \(5,\)"):
        pack_ops(plan.ops, lay, kv, out=torch.zeros(5))


@pytest.mark.parametrize(("shapes", "per_chunk_layers"), [
    (((2, 2), (1, 1)), 1), (((2, 2), (1, 1)), 2), (((1, 1), (1, 1)), 2), (((1, 1), (2, 1)), 3), (((1, 1), (1, 1)), 0),
])
def test_pair_chunks_are_consecutive_slices_of_the_one_buffer_layout(shapes, per_chunk_layers):
    """torch_dist's gloo chunks: cut at layer boundaries, each at least `chunk_bytes` but the last
    (here 1 to 3 layers' bytes, or 0: one chunk), and packing each into its slice gives the
    one-buffer bytes exactly (tp 2 x pp 2 -> 1: several ops a pair; 1 -> 2: head slices)."""
    from splitserve.engine.transfer.p2p_messages import pair_chunks
    from splitserve.engine.transfer.pack import op_numel

    src, dst = layout(*shapes[0], 4), layout(*shapes[1], 4)
    n, pool = 5, 8
    src_t, dst_t = block_tables(src, n, pool, 8), block_tables(dst, n, pool, 9)
    plan = build_plan(src, dst, src_t, dst_t)
    src_kv = scatter(random_logical(src, n, seed=7), src, src_t, pool)
    for (s, d) in plan.bytes_by_pair():
        ops = plan.ops_for_pair(s, d)
        whole = pack_ops(ops, src, src_kv[s])
        layer_bytes = op_numel(ops[0], src) // ops[0].num_layers * whole.element_size()  # every op's layers alike
        chunks = pair_chunks(ops, src, per_chunk_layers * layer_bytes - per_chunk_layers // 2, whole.element_size())
        layers = sum(op.num_layers for op in ops)
        assert len(chunks) == (-(-layers // per_chunk_layers) if per_chunk_layers else 1)
        offset, pieced = 0, torch.full_like(whole, SENTINEL)
        for i, (start, numel, chunk_ops) in enumerate(chunks):
            assert start == offset and numel == packed_numel(chunk_ops, src)
            assert i == len(chunks) - 1 or sum(op.num_layers for op in chunk_ops) == per_chunk_layers
            pack_ops(chunk_ops, src, src_kv[s], out=pieced[start:start + numel])
            offset += numel
        assert offset == whole.numel() and torch.equal(pieced, whole)


@pytest.mark.parametrize("shapes", [((1, 2), (1, 1)), ((1, 1), (2, 2)), ((2, 1), (1, 2))])
def test_layer_groups_cut_a_pair_into_its_source_layers_in_order(shapes):
    """torch_dist's layer-wise push: one group per source local layer, ascending, each op cut to that
    layer; the groups hold every (layer, head, block) of the pair exactly once. Without `by_layer`:
    one group of every op, at the last layer they read."""
    from splitserve.engine.transfer.p2p_messages import layer_groups

    src, dst = layout(*shapes[0], 4, num_layers=5), layout(*shapes[1], 4, num_layers=5)
    n, pool = 4, 8
    plan = build_plan(src, dst, block_tables(src, n, pool, 1), block_tables(dst, n, pool, 2))
    for (s, d) in plan.bytes_by_pair():
        ops = plan.ops_for_pair(s, d)
        cells = {(op.layer_start + i, op.src_head_start + h, b) for op in ops for i in range(op.num_layers)
                 for h in range(op.num_heads) for b in op.src_blocks()}
        [(last, every)] = layer_groups(ops, by_layer=False)
        assert every == ops and last == max(op.src_layer_start + op.num_layers for op in ops) - 1
        groups = layer_groups(ops, by_layer=True)
        layers = [layer for layer, _ in groups]
        assert layers == sorted(set(layers)) and len(groups) == len({op.layer_start + i for op in ops
                                                                      for i in range(op.num_layers)})
        got = []
        for layer, cut in groups:
            assert all(op.num_layers == 1 and op.src_layer_start == layer for op in cut)
            got += [(op.layer_start, op.src_head_start + h, b) for op in cut for h in range(op.num_heads)
                    for b in op.src_blocks()]
        assert sorted(got) == sorted(cells) and len(got) == len(cells)


def test_direct_runs_are_the_long_runs_of_ops_holding_every_head_on_a_side():
    """torch_dist's per-run messages: only runs whose one-layer K reaches `direct_bytes` (here in
    bytes of a layer's K of the op's heads), of ops holding every local head of at least one side;
    the other runs stay in a packed op."""
    from splitserve.engine.transfer.p2p_messages import direct_runs
    from splitserve.engine.transfer.plan import BlockRun

    lay = layout(1, 1, 2)  # a block's K of one layer: 2 heads x 2 slots x 4 dims x 4 bytes = 64 bytes
    plan = build_plan(lay, lay, {0: [0, 1, 2, 3, 4]}, {0: [4, 5, 6, 0, 2]})
    (op,) = plan.ops
    direct, packed = direct_runs(plan.ops, lay, lay, 2 * 64, 4)
    assert direct == [(op, BlockRun(0, 4, 3))]
    assert [o.block_runs for o in packed] == [(BlockRun(3, 0, 1), BlockRun(4, 2, 1))]
    assert direct_runs(plan.ops, lay, lay, 0, 4) == ([], list(plan.ops))
    assert len(direct_runs(plan.ops, lay, lay, 1, 4)[0]) == 3 and direct_runs(plan.ops, lay, lay, 1, 4)[1] == []
    src, dst = layout(2, 1, 4), layout(1, 1, 4)  # tp 2 -> 1: each op every head of its source, half the destination's
    merge = build_plan(src, dst, {0: [0, 1], 1: [0, 1]}, {0: [0, 1]})
    assert [op for op, _ in direct_runs(merge.ops, src, dst, 2 * 64, 4)[0]] == list(merge.ops)
    assert direct_runs(merge.ops, src, dst, 2 * 64 + 1, 4) == ([], list(merge.ops))
    replicated = layout(1, 1, 1), layout(2, 1, 1)  # one head, replicated on the destination: whole on both
    split = build_plan(*replicated, {0: [0, 1]}, {0: [2, 3], 1: [0, 1]})
    assert len(direct_runs(split.ops, *replicated, 1, 4)[0]) == len(split.ops) == 2


def test_run_messages_read_whole_head_regions_in_place_and_stage_the_rest():
    """Where a side holds every head the message is its pool's own memory (a receive lands in
    place); a head slice, or a pool tensor that is not contiguous, goes through staging."""
    from splitserve.engine.transfer.p2p_messages import direct_runs, run_messages

    src, dst = layout(1, 1, 4), layout(2, 1, 4)  # tp 1 -> 2: a head slice on the source, whole on the destination
    plan = build_plan(src, dst, {0: [0, 1, 2]}, {0: [3, 4, 5], 1: [0, 1, 2]})
    src_kv = scatter(random_logical(src, 3, seed=3), src, {0: [0, 1, 2]}, 6)[0]
    dst_kv = [torch.zeros(dst.kv_shape(6)) for _ in range(3)]
    direct, packed = direct_runs(plan.ops_for_pair(0, 0), src, dst, 1, 4)
    assert len(direct) == 1 and packed == []
    staging = []
    src_msgs = run_messages(direct, src, src_kv, "src", lambda n: staging.append(n) or torch.zeros(n))
    assert staging == [3 * 2 * 3 * 2 * 2 * 4] and all(region is not None for _, region in src_msgs)
    dst_msgs = run_messages(direct, dst, dst_kv, "dst", lambda n: torch.zeros(n))
    assert len(dst_msgs) == 3 * 2 and all(region is None for _, region in dst_msgs)
    message = dst_msgs[1][0]  # layer 0's V, blocks 3-5: the pool's bytes themselves
    message.view(torch.float32).fill_(7.0)
    assert torch.all(dst_kv[0][1, 3:6] == 7.0) and torch.all(dst_kv[0][0] == 0)
    strided = [t.transpose(3, 4).contiguous().transpose(3, 4) for t in dst_kv]  # same values, not contiguous
    assert all(region is not None for _, region in run_messages(direct, dst, strided, "dst", torch.zeros))
