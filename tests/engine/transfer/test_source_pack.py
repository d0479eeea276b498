"""Source-packed reshards (engine/transfer/source_pack.py): the source gathers the head slices a
destination layout reads strided into its registered arena, the destination reads them as a few
contiguous regions — same bytes as reading the pool, through real NIXL agents."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from kvtransfer_helpers import SENTINEL, assert_pools_equal, block_tables, layout, random_logical, scatter

from splitserve.engine.transfer.plan import build_plan
from splitserve.engine.transfer.source_pack import PackArena, pack_groups


@pytest.mark.parametrize(("src", "dst", "rank", "groups"), [
    ((1, 1, 8), (2, 1, 8), 0, [(0, 4), (4, 4)]),
    ((2, 1, 8), (1, 1, 8), 1, []),  # the destination takes all of each source rank's heads
    ((1, 1, 2), (4, 1, 2), 0, [(0, 1), (1, 1)]),  # GQA, replicated heads on the destination
    ((2, 1, 4), (4, 2, 4), 1, [(0, 1), (1, 1)]),
    ((1, 2, 4), (2, 1, 4), 1, [(0, 2), (2, 2)]),  # PP stage 1's rank
])
def test_pack_groups_are_the_strided_head_slices(src, dst, rank, groups):
    assert pack_groups(layout(*src), layout(*dst), rank) == groups


def test_the_arena_reuses_freed_room_and_says_when_it_is_full():
    arena = PackArena(torch.empty(4096, dtype=torch.uint8))
    a, b = arena.alloc(1000), arena.alloc(1000)
    assert (a, b) == (0, 1024)  # aligned to 256 bytes
    assert arena.alloc(4096) is None
    arena.free(a, 1000)
    assert arena.alloc(1024) == 0
    arena.free(0, 1024)
    arena.free(b, 1000)
    assert arena.free_bytes == 4096 and arena.alloc(4096) == 0


def _case(src_lay, dst_lay, first_block, seed, num_blocks=5, pool=9):
    logical = random_logical(src_lay, num_blocks, seed)
    # Scattered on the source, runs on the destination (a fresh decode allocation): reading the
    # pool takes a region per block, the packed arena a region per (layer, K|V) and block run.
    src_t = block_tables(src_lay, num_blocks, pool, seed)
    dst_t = block_tables(dst_lay, num_blocks, pool, seed + 1, contiguous=True)
    plan = build_plan(src_lay, dst_lay, src_t, dst_t, first_block)
    src_kv = scatter(logical, src_lay, src_t, pool)
    dst_kv = scatter(torch.full_like(logical, SENTINEL), dst_lay, dst_t, pool)
    expected = logical.clone()
    expected[:, :, :first_block] = SENTINEL
    return plan, src_t, src_kv, dst_kv, scatter(expected, dst_lay, dst_t, pool)


def _nixl():
    pytest.importorskip("nixl_cu13")
    from splitserve.engine.transfer.nixl_transport import NixlTransport

    return NixlTransport


@pytest.mark.parametrize(("src", "dst", "first_block"), [
    ((1, 1, 8), (2, 1, 8), 0),
    ((1, 2, 8), (2, 1, 8), 2),  # PP mismatch, and a prefix hit on the destination
    ((1, 1, 2), (4, 1, 2), 1),  # GQA: 2 kv heads at TP 4
    ((2, 1, 4), (4, 2, 4), 0),
    ((2, 1, 4), (1, 1, 4), 0),  # nothing strided on the source: a plain pull
], ids=["tp1-tp2", "pp2-tp2-prefix", "gqa-tp1-tp4", "tp2-tp4pp2", "tp2-tp1"])
def test_packed_pulls_deliver_the_plan_bit_for_bit_in_fewer_regions(src, dst, first_block):
    transport = _nixl()
    src_lay, dst_lay = layout(*src), layout(*dst)
    plan, src_t, src_kv, dst_kv, expected = _case(src_lay, dst_lay, first_block, seed=31)
    plain_kv = {rank: [t.clone() for t in kv] for rank, kv in dst_kv.items()}
    with transport() as dst_x:
        endpoints = [transport(pack_arena_bytes=1 << 20) for _ in range(src_lay.world_size)]
        try:
            plain = {rank: endpoints[rank].expose(kv) for rank, kv in src_kv.items()}
            packed = {}
            for rank, kv in src_kv.items():
                accepted = endpoints[rank].pack_begin("r1", src_lay, dst_lay, rank, src_t[rank])
                assert accepted == bool(pack_groups(src_lay, dst_lay, rank))
                endpoints[rank].pack_layers("r1", kv, 0, len(kv))
                packed[rank] = endpoints[rank].packed_metadata("r1")
            for rank in range(dst_lay.world_size):
                want = sum(n for (_, d), n in plan.bytes_by_pair().items() if d == rank)
                got = dst_x.pull(plan, rank, packed, dst_kv[rank])
                ref = transport(stage_reshards=False)
                try:
                    base = ref.pull(plan, rank, plain, plain_kv[rank])
                finally:
                    ref.close()
                assert got.num_bytes == base.num_bytes == want
                if any(pack_groups(src_lay, dst_lay, r) for r in plan.sources_for(rank)):
                    assert got.num_regions < base.num_regions, (got, base)
                else:
                    assert got.num_regions == base.num_regions
            for e in endpoints:
                e.pack_release("r1")
                assert e.packed_requests() == []
        finally:
            for e in endpoints:
                e.close()
    assert_pools_equal(dst_kv, expected, "packed pull")
    assert_pools_equal(plain_kv, expected, "pool pull")


def test_a_full_arena_falls_back_to_reading_the_pool_and_release_gives_the_room_back():
    transport = _nixl()
    src_lay, dst_lay = layout(1, 1, 8), layout(2, 1, 8)
    plan, src_t, src_kv, dst_kv, expected = _case(src_lay, dst_lay, 0, seed=5)
    need = 2 * 3 * 2 * 5 * 4 * src_lay.head_block_bytes  # 2 groups x layers x K|V x blocks x heads
    with transport(pack_arena_bytes=need) as src_x, transport() as dst_x:
        src_x.expose(src_kv[0])
        assert src_x.pack_begin("a", src_lay, dst_lay, 0, src_t[0])
        assert not src_x.pack_begin("b", src_lay, dst_lay, 0, src_t[0])  # full: b reads the pool
        src_x.pack_layers("a", src_kv[0], 0, 3)
        for rank in range(2):
            dst_x.pull(plan, rank, {0: src_x.packed_metadata("b")}, dst_kv[rank])
        assert_pools_equal(dst_kv, expected, "pool fallback")
        src_x.pack_release("a")
        assert src_x.pack_begin("b", src_lay, dst_lay, 0, src_t[0])


def test_a_layer_not_yet_packed_reads_stale_bytes_that_the_checksums_catch():
    """Publishing before packing is the source's bug; the destination's verification still refuses
    the import (unit checksums over the pool), so stale packed bytes are never used silently."""
    transport = _nixl()
    from splitserve.engine.transfer.checksum import unit_checksums, verify_unit_checksums

    src_lay, dst_lay = layout(1, 1, 8), layout(2, 1, 8)
    plan, src_t, src_kv, dst_kv, _ = _case(src_lay, dst_lay, 0, seed=9)
    dst_t = block_tables(dst_lay, 5, 9, 10, contiguous=True)
    sums = unit_checksums(src_kv[0], src_lay, 0, src_t[0], 0)
    with transport(pack_arena_bytes=1 << 20) as src_x, transport() as dst_x:
        src_x.expose(src_kv[0])
        src_x.pack_begin("r", src_lay, dst_lay, 0, src_t[0])
        src_x.pack_layers("r", src_kv[0], 0, 2)  # layer 2 never packed
        dst_x.pull(plan, 0, {0: src_x.packed_metadata("r")}, dst_kv[0])
    bad = verify_unit_checksums(dst_kv[0], dst_lay, 0, dst_t[0], sums, 0)
    assert bad and {layer for layer, _ in bad} == {2}, bad


def test_streamed_pull_reads_each_layer_once_the_source_packed_and_marked_it():
    transport = _nixl()
    from splitserve.engine.transfer.progress import request_tag
    from splitserve.engine.transfer.streaming import StreamSpec, streamed_pull

    src_lay, dst_lay = layout(1, 1, 8, num_layers=4), layout(2, 1, 8, num_layers=4)
    plan, src_t, src_kv, dst_kv, expected = _case(src_lay, dst_lay, 0, seed=13)
    with transport(pack_arena_bytes=1 << 20) as src_x, transport() as dst_x:
        src_x.expose(src_kv[0])
        slot = src_x.board.open("s")
        assert src_x.pack_begin("s", src_lay, dst_lay, 0, src_t[0])
        meta = src_x.packed_metadata("s")

        def prefill():  # each layer: packed, then marked (the order a source must keep)
            for layer in range(4):
                time.sleep(0.05)
                src_x.pack_layers("s", src_kv[0], layer, layer + 1)
                src_x.board.mark(slot, layer, src_kv[0][layer], src_t[0], 10)

        thread = threading.Thread(target=prefill)
        thread.start()
        try:
            for rank in range(2):
                stats = streamed_pull(dst_x, plan, rank, {0: meta}, dst_kv[rank],
                                      StreamSpec(slot, request_tag("s"), 10), timeout_s=30)
                assert stats.num_bytes == plan.bytes_by_pair()[(0, rank)]
        finally:
            thread.join()
    assert_pools_equal(dst_kv, expected, "streamed packed pull")


def test_packed_pull_between_gpu_pools():
    """VRAM arena and pools (the GPU path packs by one gather per layer and group)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    transport = _nixl()
    src_lay, dst_lay = layout(1, 1, 8), layout(2, 1, 8)
    plan, src_t, src_kv, dst_kv, expected = _case(src_lay, dst_lay, 1, seed=17)
    src_kv = {r: [t.cuda() for t in kv] for r, kv in src_kv.items()}
    dst_kv = {r: [t.cuda() for t in kv] for r, kv in dst_kv.items()}
    with transport(pack_arena_bytes=1 << 20) as src_x, transport() as dst_x:
        src_x.expose(src_kv[0])
        assert src_x.pack_begin("g", src_lay, dst_lay, 0, src_t[0])
        src_x.pack_layers("g", src_kv[0], 0, 3)
        for rank in range(2):
            dst_x.pull(plan, rank, {0: src_x.packed_metadata("g")}, dst_kv[rank])
    assert_pools_equal({r: [t.cpu() for t in kv] for r, kv in dst_kv.items()}, expected, "packed pull, GPU")


def test_layers_packed_after_the_forward_pass_into_a_job_begun_inside_it():
    """A prefill worker begins a job from its layer listener (inside the forward pass's
    inference mode) and packs the layers the listener did not reach after the step, outside it
    (a hybrid model's, or all of them without layer-wise streaming): that must not raise
    "Inplace update to inference tensor outside InferenceMode" (it crashed the engine loop)."""
    transport = _nixl()
    src_lay, dst_lay = layout(1, 1, 8), layout(2, 1, 8)
    plan, src_t, src_kv, dst_kv, expected = _case(src_lay, dst_lay, 0, seed=11)
    with transport(pack_arena_bytes=1 << 20) as src_x, transport() as dst_x:
        src_x.expose(src_kv[0])
        with torch.inference_mode():
            assert src_x.pack_begin("r", src_lay, dst_lay, 0, src_t[0])
            src_x.pack_layers("r", src_kv[0], 0, 1)
        src_x.pack_layers("r", src_kv[0], 1, 3)
        for rank in range(2):
            dst_x.pull(plan, rank, {0: src_x.packed_metadata("r")}, dst_kv[rank])
    assert_pools_equal(dst_kv, expected, "packed across inference mode")
