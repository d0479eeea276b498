from __future__ import annotations

import pytest

from splitserve.engine.transfer.layout import KVLayout, default_layer_ranges


def _lay(**kw):
    base = dict(dtype="bfloat16", block_size=16, tp=2, pp=2, num_layers=5, num_kv_heads=8, head_dim=64)
    return KVLayout(**(base | kw))


def test_default_layer_ranges_front_load_the_extra_layers():
    assert default_layer_ranges(5, 2) == ((0, 3), (3, 5))
    assert default_layer_ranges(7, 3) == ((0, 3), (3, 5), (5, 7))
    assert default_layer_ranges(4, 1) == ((0, 4),)
    with pytest.raises(ValueError, match="num_layers=1 is fewer than pp=2"):
        default_layer_ranges(1, 2)


def test_ranks_layers_heads_and_sizes():
    lay = _lay()
    assert lay.layer_ranges == ((0, 3), (3, 5))
    assert [(lay.tp_rank(r), lay.pp_rank(r)) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert lay.rank(1, 1) == 3 and lay.world_size == 4
    assert [lay.stage_of(i) for i in range(5)] == [0, 0, 0, 1, 1]
    assert lay.local_layer(4) == 1 and lay.num_local_layers(1) == 2
    assert lay.heads_of(1) == (4, 8) and lay.holders_of(5) == (1,)
    assert lay.num_local_heads == 4 and lay.num_replicas == 1
    assert lay.head_block_bytes == 16 * 64 * 2
    assert lay.block_bytes(0) == 3 * 2 * 4 * 16 * 64 * 2
    assert lay.kv_shape(10) == (2, 10, 4, 16, 64)


def test_replicated_heads():
    lay = _lay(tp=4, pp=1, num_kv_heads=2)
    assert [lay.heads_of(r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert lay.holders_of(1) == (2, 3) and lay.num_replicas == 2 and lay.num_local_heads == 1
    assert lay.is_primary(2, 1) and not lay.is_primary(3, 1)


@pytest.mark.parametrize(("kw", "message"), [
    (dict(num_kv_heads=6, tp=4), "num_kv_heads=6 is not divisible by tp=4"),
    (dict(num_kv_heads=2, tp=3), "tp=3 is not a multiple of num_kv_heads=2"),
    (dict(dtype="int8"), "dtype 'int8' is not one of"),
    (dict(block_size=0), "block_size must be a positive int, got 0"),
    (dict(layer_ranges=((0, 2), (3, 5))), r"stage 1 is \(3, 5\)"),
    (dict(layer_ranges=((0, 2), (2, 4))), "end at 4, expected num_layers=5"),
    (dict(layer_ranges=((0, 5),)), "has 1 stages, expected pp=2"),
    (dict(pp=6), "num_layers=5 is fewer than pp=6"),
])
def test_bad_layouts_are_refused_clearly(kw, message):
    with pytest.raises(ValueError, match=message):
        _lay(**kw)


def test_rank_bounds():
    lay = _lay()
    with pytest.raises(ValueError, match=r"rank 4 out of range \[0, 4\)"):
        lay.pp_rank(4)
    with pytest.raises(ValueError, match=r"tp_rank 2 out of range"):
        lay.heads_of(2)
    with pytest.raises(ValueError, match=r"layer 5 out of range"):
        lay.stage_of(5)
