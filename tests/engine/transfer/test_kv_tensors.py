"""check_kv_tensors: what it refuses, and its memo of passed checks (identity of the very tensors)."""

import gc
import weakref

import pytest
import torch

from splitserve.engine.transfer import kv_tensors
from splitserve.engine.transfer.kv_tensors import check_kv_tensors
from splitserve.engine.transfer.layout import KVLayout


def _layout(tp: int = 1, kv_heads: int = 4) -> KVLayout:
    return KVLayout(dtype="float32", block_size=4, tp=tp, pp=1, num_layers=3, num_kv_heads=kv_heads, head_dim=8)


def _pool(blocks: int = 5, heads: int = 4, dtype=torch.float32) -> list[torch.Tensor]:
    return [torch.zeros(2, blocks, heads, 4, 8, dtype=dtype) for _ in range(3)]


def test_a_matching_pool_passes_and_returns_its_size():
    pool = _pool(blocks=7)
    assert check_kv_tensors(pool, _layout(), 0) == 7
    assert check_kv_tensors(pool, _layout(), 0) == 7  # from the memo


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda: _pool()[:2], "has 2 KV tensors"),
        (lambda: _pool(heads=2), "has shape"),
        (lambda: _pool(dtype=torch.float16), "dtype"),
        (lambda: [t.transpose(3, 4) for t in _pool()], "shape|contiguous"),
        (lambda: [*_pool()[:2], torch.zeros(2, 5, 4, 8, 4).transpose(3, 4)], "contiguous"),
    ],
)
def test_mismatches_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        check_kv_tensors(bad(), _layout(), 0)


def test_the_memo_answers_only_for_the_very_tensors_checked(monkeypatch):
    pool = _pool()
    check_kv_tensors(pool, _layout(), 0)
    calls = []
    real = kv_tensors._check
    monkeypatch.setattr(kv_tensors, "_check", lambda *a: calls.append(a) or real(*a))
    check_kv_tensors(pool, _layout(), 0)  # same objects, an equal layout: no walk
    check_kv_tensors(list(pool), _layout(), 0)  # another list of the same tensors: still no walk
    assert calls == []
    swapped = [pool[0], pool[1], torch.zeros(2, 5, 4, 8, 4)]  # one tensor replaced by a wrong one
    with pytest.raises(ValueError, match="tensor 2 has shape"):
        check_kv_tensors(swapped, _layout(), 0)
    with pytest.raises(ValueError, match="has shape"):  # same tensors, another layout: checked again
        check_kv_tensors(pool, _layout(tp=2), 0)
    assert len(calls) == 2


def test_the_memo_does_not_keep_a_pool_alive():
    pool = _pool()
    check_kv_tensors(pool, _layout(), 0)
    refs = [weakref.ref(t) for t in pool]
    del pool
    gc.collect()
    assert all(r() is None for r in refs)


def test_a_held_pool_check_skips_only_the_very_tuple_it_passed(monkeypatch):
    """`HeldPoolCheck` (a transport's destination pool): the same tuple, layout and rank are not
    checked again; another tuple, a list, another layout or rank go through `check_kv_tensors`."""
    check = kv_tensors.HeldPoolCheck()
    pool = tuple(_pool(blocks=6))
    calls = []
    real = kv_tensors.check_kv_tensors
    monkeypatch.setattr(kv_tensors, "check_kv_tensors", lambda *a: calls.append(a) or real(*a))
    assert check(pool, _layout(), 0) == 6
    assert check(pool, _layout(), 0) == 6
    assert len(calls) == 1
    check(list(pool), _layout(), 0)  # a list can change: checked
    check(list(pool), _layout(), 0)
    assert len(calls) == 3
    with pytest.raises(ValueError, match="has shape"):  # another layout: checked (and refused)
        check(pool, _layout(tp=2), 0)
    bad = (*pool[:2], torch.zeros(2, 6, 4, 8, 4))
    with pytest.raises(ValueError, match="tensor 2 has shape"):
        check(bad, _layout(), 0)
    check.clear()
    check(pool, _layout(), 0)
    assert len(calls) == 6
