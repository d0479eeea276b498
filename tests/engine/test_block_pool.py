"""Exact-state tests of the block pool and prefix cache."""

import pytest

from splitserve.engine.block_hash import hash_block, hash_blocks
from splitserve.engine.block_pool import BlockPool, NoFreeBlocksError


def _state(pool: BlockPool):
    s = pool.stats()
    return s.num_free, s.num_cached, s.num_in_use, s.num_pinned


def test_chained_hashes_identify_the_whole_prefix():
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7], block_size=2)
    b = hash_blocks([1, 2, 3, 4, 9, 9], block_size=2)
    c = hash_blocks([0, 2, 3, 4], block_size=2)
    assert len(a) == 3 and len(b) == 3  # the partial tail is not hashed
    assert a[:2] == b[:2] and a[2] != b[2]
    assert c[1] != a[1]  # same block tokens, different parent
    assert a[1] == hash_block(a[0], [3, 4])


def test_packed_hashing_gives_the_per_block_chain():
    """hash_blocks packs the whole span once; every hash must equal the per-block definition,
    also for a request whose blocks straddle prompt and output tokens, hashed incrementally."""
    import random

    from splitserve.engine.request import Request
    from splitserve.engine.sampling_params import SamplingParams

    rng = random.Random(3)
    tokens = [rng.randrange(0, 2**32) for _ in range(16 * 37 + 5)]
    chain, parent = [], None
    for start in range(0, 16 * 37, 16):
        parent = hash_block(parent, tokens[start : start + 16])
        chain.append(parent)
    assert hash_blocks(tokens, 16) == chain
    assert hash_blocks(tokens[32:], 16, parent=chain[1]) == chain[2:]
    req = Request("r", tokens[:100], SamplingParams(), (), 500)
    req.extend_block_hashes(16)
    req.output_token_ids.extend(tokens[100:300])
    req.extend_block_hashes(16)
    assert req.block_hashes == chain[: 300 // 16]
    with pytest.raises(Exception):  # noqa: B017 - struct.error, as before: ids are uint32
        hash_blocks([-1] * 16, 16)


def test_allocate_free_exact_state():
    pool = BlockPool(4, "lru")
    assert pool.allocate(3) == [0, 1, 2]
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert _state(pool) == (1, 0, 3, 0)
    pool.free([2, 1, 0])
    assert _state(pool) == (4, 0, 0, 0)
    assert list(pool._free) == [3, 2, 1, 0]
    with pytest.raises(NoFreeBlocksError, match="asked for 5 blocks, 4 available"):
        pool.allocate(5)
    with pytest.raises(ValueError, match="double free of block 3"):
        pool.free([3])
    pool.check_integrity()


def test_lru_keeps_cached_blocks_until_space_is_needed():
    pool = BlockPool(3, "lru")
    h = hash_blocks(list(range(8)), 4)
    blocks = pool.allocate(2)
    pool.register(blocks[0], h[0], None)
    pool.register(blocks[1], h[1], h[0])
    pool.free(reversed(blocks))
    assert _state(pool) == (1, 2, 0, 0)
    assert list(pool._evictable) == [1, 0]  # tail block first in eviction order
    assert pool.lookup(h) == [0, 1]
    pool.ref([0])  # a hit revives block 0
    assert _state(pool) == (1, 1, 1, 0) and pool.ref_count(0) == 1
    # Needing 2 blocks takes the free one, then evicts block 1 (its hash goes); ids come sorted.
    assert pool.allocate(2) == [1, 2]
    assert pool.lookup(h) == [0] and pool.hash_of(1) is None
    events = pool.drain_events()
    assert [e.kind for e in events] == ["stored", "stored", "removed"]
    assert events[2].block_hashes == (h[1],)
    pool.free([0, 1, 2])
    pool.check_integrity()
    assert _state(pool) == (2, 1, 0, 0)


def test_ref_zero_drops_cache_entries_immediately():
    pool = BlockPool(2, "ref_zero")
    h = hash_blocks([1, 2], 2)
    [b] = pool.allocate(1)
    pool.register(b, h[0], None)
    pool.ref([b])  # a second request shares it
    assert pool.lookup(h) == [b] and pool.ref_count(b) == 2
    pool.free([b])
    assert pool.lookup(h) == [b]  # still referenced, still shared
    pool.free([b])
    assert pool.lookup(h) == [] and _state(pool) == (2, 0, 0, 0)
    pool.check_integrity()


def test_duplicate_registration_keeps_the_first_block():
    pool = BlockPool(2)
    h = hash_blocks([5, 5], 2)[0]
    a, b = pool.allocate(2)
    pool.register(a, h, None)
    pool.register(b, h, None)
    assert pool.hash_of(a) == h and pool.hash_of(b) is None
    pool.free([b, a])
    assert _state(pool) == (1, 1, 0, 0)
    pool.check_integrity()


def test_pins_are_references_without_an_owner():
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    pool.pin(blocks)
    pool.free(blocks)  # the request lets go; the pin holds the blocks
    assert _state(pool) == (1, 0, 2, 2)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    pool.unpin(blocks)
    assert _state(pool) == (3, 0, 0, 0)
    with pytest.raises(ValueError, match="not pinned"):
        pool.unpin([0])
    pool.check_integrity()


def test_ref_of_a_free_block_is_refused():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="block 0 is free"):
        pool.ref([0])


def test_integrity_check_catches_corruption():
    pool = BlockPool(3)
    pool.allocate(1)
    pool._free.append(0)  # simulate a bug: block 0 both free and in use
    with pytest.raises(AssertionError, match="two states"):
        pool.check_integrity()


def test_caching_disabled_never_hits():
    pool = BlockPool(2, enable_caching=False)
    [b] = pool.allocate(1)
    h = hash_blocks([1, 1], 2)
    pool.register(b, h[0], None)
    assert pool.lookup(h) == [] and pool.hash_of(b) is None
    pool.free([b])
    assert _state(pool) == (2, 0, 0, 0)


def test_reset_prefix_cache_clears_idle_blocks():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.register(b, hash_blocks([1, 2], 2)[0], None)
    pool.free([b])
    pool.drain_events()
    pool.reset_prefix_cache()
    assert _state(pool) == (2, 0, 0, 0)
    assert [e.kind for e in pool.drain_events()] == ["cleared"]
    pool.check_integrity()


def test_a_recycled_table_comes_back_as_one_run():
    """Tables are freed tail-first; the next allocation of those blocks still hands out ascending,
    consecutive ids, so a handoff of it is one block run (transfer/plan.py), not one per block."""
    from splitserve.engine.transfer.layout import KVLayout
    from splitserve.engine.transfer.plan import build_plan

    for caching in (True, False):
        pool = BlockPool(64, "lru", enable_caching=caching)
        first = pool.allocate(16)
        if caching:
            for b, h in zip(first, hash_blocks(list(range(64)), 4), strict=True):
                pool.register(b, h, None)
        pool.allocate(48)
        pool.free(reversed(first))
        again = pool.allocate(16)
        assert again == list(range(16))
        layout = KVLayout("float32", 4, 1, 1, 2, 2, 8)
        plan = build_plan(layout, layout, {0: again}, {0: again})
        assert [len(op.block_runs) for op in plan.ops] == [1]
        pool.check_integrity()
