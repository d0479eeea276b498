"""PrefixIndex exact state under stored / removed / cleared, lookups, resync, worker removal; TTL mode."""

from __future__ import annotations

import pytest

from splitserve.engine.block_hash import hash_blocks
from splitserve.router.approximate import RoutedPrefixes
from splitserve.router.prefix_index import PrefixIndex

BS = 4
PROMPT_A = list(range(1, 17))  # 4 full blocks
PROMPT_B = list(range(1, 9)) + [99] * 8  # shares A's first 2 blocks
A = hash_blocks(PROMPT_A, BS)
B = hash_blocks(PROMPT_B, BS)


def test_chained_hashes_share_exactly_the_common_prefix():
    assert A[:2] == B[:2] and A[2] != B[2]


def test_store_remove_clear_exact_state():
    index = PrefixIndex()
    index.store("w0", A)
    index.store("w1", A[:2])
    index.store("w1", B)  # B[:2] == A[:2]: stored twice, counted once
    assert index.blocks_of("w0") == frozenset(A)
    assert index.blocks_of("w1") == frozenset(A[:2] + B[2:])
    assert index.num_distinct_blocks == 6
    assert index.holders(A[0]) == {"w0", "w1"}
    assert index.holders(B[3]) == {"w1"}
    index.check_integrity()

    index.remove("w0", [A[3], b"unknown-hash-000"])
    assert index.blocks_of("w0") == frozenset(A[:3])
    assert index.holders(A[3]) == frozenset()
    assert index.num_distinct_blocks == 5
    index.check_integrity()

    index.clear("w1")
    assert index.blocks_of("w1") == frozenset()
    assert index.worker_ids == ("w0", "w1")  # cleared, still known
    assert index.num_distinct_blocks == 3
    assert index.holders(A[0]) == {"w0"}
    index.check_integrity()


def test_lookup_walks_contiguous_prefixes_of_every_worker():
    index = PrefixIndex()
    index.store("w0", A)  # all 4
    index.store("w1", A[:2])  # 2
    index.store("w2", [A[0], A[2], A[3]])  # a hole at block 1: only 1 counts
    index.store("w3", A[1:])  # no first block: 0, omitted
    index.store("w4", B)  # 2 shared with A
    assert index.lookup(A) == {"w0": 4, "w1": 2, "w2": 1, "w4": 2}
    assert index.lookup(B) == {"w0": 2, "w1": 2, "w2": 1, "w4": 4}
    assert index.lookup(A[:1]) == {"w0": 1, "w1": 1, "w2": 1, "w4": 1}
    assert index.lookup([]) == {}
    assert index.lookup(hash_blocks([5] * 8, BS)) == {}


def test_replace_is_an_exact_resync_and_drop_worker_frees_its_slot():
    index = PrefixIndex()
    index.store("w0", A)
    index.store("w1", A)
    index.replace("w0", B)
    assert index.blocks_of("w0") == frozenset(B)
    assert index.blocks_of("w1") == frozenset(A)
    assert index.lookup(A) == {"w0": 2, "w1": 4}
    index.check_integrity()

    index.drop_worker("w0")
    assert index.worker_ids == ("w1",)
    assert index.holders(B[3]) == frozenset()
    assert index.num_distinct_blocks == 4
    index.store("w2", B)  # reuses w0's bit: must not inherit anything
    assert index.lookup(A) == {"w1": 4, "w2": 2}
    index.check_integrity()
    index.drop_worker("never-known")  # no-op


def test_many_workers_beyond_64_bits():
    index = PrefixIndex()
    for number in range(130):
        index.store(f"w{number:03d}", A[: 1 + number % 4])
    depths = index.lookup(A)
    assert len(depths) == 130
    assert all(depth == 1 + int(worker_id[1:]) % 4 for worker_id, depth in depths.items())
    index.check_integrity()


def test_bad_worker_id_is_rejected_with_the_value():
    with pytest.raises(ValueError, match="''"):
        PrefixIndex().store("", A)


def test_routed_prefixes_expire_after_ttl_and_refresh_on_reuse():
    index = PrefixIndex()
    routed = RoutedPrefixes(index, ttl_s=10.0)
    routed.record("w0", A, now=0.0)
    routed.record("w1", B, now=5.0)
    assert routed.expire(now=9.0) == 0
    routed.record("w0", A[:2], now=9.0)  # refreshed: expires at 19
    assert routed.expire(now=10.0) == 2  # A[2], A[3] of w0
    assert index.blocks_of("w0") == frozenset(A[:2])
    assert routed.expire(now=15.0) == 4  # all of w1
    assert index.blocks_of("w1") == frozenset()
    assert routed.expire(now=19.0) == 2
    assert index.num_distinct_blocks == 0
    index.check_integrity()
    routed.record("w2", A, now=20.0)
    routed.drop_worker("w2")
    assert routed.expire(now=100.0) == 0
    assert index.worker_ids == ("w0", "w1")
    with pytest.raises(ValueError, match="0"):
        RoutedPrefixes(index, ttl_s=0)
