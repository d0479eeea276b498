"""The recurrent-state pool: exact slot and prefix-index state, LRU eviction, pins, integrity."""

import pytest
import torch

from splitserve.engine.block_hash import hash_block
from splitserve.engine.state_pool import NoFreeStateSlotError, PrefixStateIndex, StatePool

SHAPES = [((6, 3), (2, 4, 5)), ((6, 3), (2, 4, 5))]  # two mamba layers: conv [C, K-1], ssm [H, P, N]


def _pool(num_slots=3, num_prefix=2):
    return StatePool(SHAPES, num_slots, num_prefix, torch.float32, torch.float32, torch.device("cpu"))


def test_slots_are_reused_in_order_and_integrity_holds():
    pool = _pool()
    assert [pool.acquire(r) for r in ("a", "b", "c")] == [0, 1, 2]
    assert pool.acquire("b") == 1  # idempotent
    with pytest.raises(NoFreeStateSlotError, match="all 3 recurrent-state slots"):
        pool.acquire("d")
    pool.release("b")
    assert pool.num_free_slots == 1 and pool.acquire("d") == 1
    pool.check_integrity({"a", "c", "d"})
    with pytest.raises(AssertionError, match="unknown requests \\['d'\\]"):
        pool.check_integrity({"a", "c"})
    pool.pinned.add("d")  # a pinned handoff owns its slot after the request left
    pool.check_integrity({"a", "c"})
    pool.release("d")
    assert "d" not in pool.pinned and pool.num_free_slots == 1


def test_reset_and_load_prefix_touch_only_their_slot():
    pool = _pool()
    for layer in pool.layers:
        layer.conv.fill_(1.0)
        layer.ssm.fill_(1.0)
        layer.prefix_conv[1].fill_(7.0)
        layer.prefix_ssm[1].fill_(8.0)
    pool.reset(0)
    pool.load_prefix(2, 1)
    for layer in pool.layers:
        assert layer.conv[0].eq(0).all() and layer.ssm[0].eq(0).all()
        assert layer.conv[1].eq(1).all() and layer.ssm[1].eq(1).all()
        assert layer.conv[2].eq(7).all() and layer.ssm[2].eq(8).all()


def test_prefix_index_is_lru_with_exact_indices():
    h = [hash_block(None, [i]) for i in range(4)]
    index = PrefixStateIndex(2)
    assert index.put(h[0]) == 0 and index.put(h[1]) == 1
    assert index.get(h[0]) == 0  # h[1] is now least recently used
    assert index.put(h[2]) == 1  # evicts h[1], reuses its index
    assert h[1] not in index and h[0] in index and len(index) == 2
    assert index.put(h[2]) == 1  # already there: same index
    index.check_integrity()
    index.clear()
    assert len(index) == 0 and index.put(h[3]) == 0
    assert PrefixStateIndex(0).put(h[0]) is None  # no budget, nothing stored
