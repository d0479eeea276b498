"""The transport's remembered pool-pair keys (engine/transfer/graph_copy.py::PoolPairKeys): a key
is reused only while both lists hold the very tensors it was computed from, and a token stands for
exactly one (addresses, shapes, strides, dtypes) key."""

from __future__ import annotations

import torch

from splitserve.engine.transfer.graph_copy import PoolPairKeys, pools_token


def _pools():
    return [torch.zeros(2, 8, 2, 4, 4) for _ in range(3)], [torch.zeros(2, 6, 2, 4, 4) for _ in range(3)]


def test_the_same_lists_reuse_their_key_and_it_equals_a_fresh_one():
    src, dst = _pools()
    keys = PoolPairKeys()
    first = keys.key(src, dst)
    assert keys.key(src, dst) is first
    assert first == pools_token(src, dst)


def test_a_replaced_or_added_tensor_gets_a_new_key():
    src, dst = _pools()
    keys = PoolPairKeys()
    first = keys.key(src, dst)
    dst[2] = torch.zeros(2, 6, 2, 4, 4)
    second = keys.key(src, dst)
    assert second != first and second == pools_token(src, dst)
    src.append(torch.zeros(2, 8, 2, 4, 4))
    assert keys.key(src, dst) == pools_token(src, dst) != second


def test_the_same_tensors_in_another_list_give_an_equal_key_and_the_memo_is_bounded():
    src, dst = _pools()
    keys = PoolPairKeys(limit=2)
    first = keys.key(src, dst)
    assert keys.key(list(src), list(dst)) == first
    for _ in range(5):
        keys.key(list(src), dst)
    assert len(keys._memo) <= 2
    views = [t[:, :4] for t in dst]  # other shapes over the same addresses: another key
    assert keys.key(src, views) != first


def test_tuples_are_trusted_by_identity_until_forget_pools():
    """A tuple cannot change, so its identity stands for its tensors; `forget_pools` (a lifecycle
    suspend / resume: the same tensor objects over new memory) makes every memo work its key out
    again, and the re-pointed tensors get a token of their new addresses."""
    from splitserve.engine.transfer.graph_copy import forget_pools

    src, dst = (tuple(p) for p in _pools())
    keys = PoolPairKeys()
    first = keys.key(src, dst)
    assert keys.key(src, dst) == first
    # what engine/lifecycle.py does to a suspended and resumed pool (the address may or may not move)
    dst[0].untyped_storage().resize_(0)
    dst[0].untyped_storage().resize_(dst[0].numel() * dst[0].element_size())
    assert keys.key(src, dst) == first  # the memo cannot see it: this is what forget_pools is for
    forget_pools()
    again = keys.key(src, dst)
    assert again != first and again == pools_token(src, dst)
