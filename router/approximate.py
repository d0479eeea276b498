"""Approximate mode: without KV events, the router indexes what it routed and forgets it after a TTL.

A worker that ran a request very likely caches its prompt's blocks for a
while; how long depends on its cache pressure, which the router cannot see,
so entries expire after `ttl_s`. Routing the same prefix again refreshes it.
Expiry is lazy (`expire(now)` before each lookup) and costs O(log n) per
expired entry.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from splitserve.engine.block_hash import BlockHash
from splitserve.router.prefix_index import PrefixIndex


class RoutedPrefixes:
    """Feeds a PrefixIndex with routed prompts, each (worker, block) expiring `ttl_s` after its last use."""

    def __init__(self, index: PrefixIndex, ttl_s: float) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        self._index = index
        self._ttl_s = ttl_s
        self._deadline: dict[tuple[str, BlockHash], float] = {}
        self._heap: list[tuple[float, str, BlockHash]] = []

    def record(self, worker_id: str, block_hashes: Sequence[BlockHash], now: float) -> None:
        """`worker_id` was just sent a prompt with these blocks."""
        deadline = now + self._ttl_s
        for block_hash in block_hashes:
            self._deadline[(worker_id, block_hash)] = deadline
            heapq.heappush(self._heap, (deadline, worker_id, block_hash))
        self._index.store(worker_id, block_hashes)

    def expire(self, now: float) -> int:
        """Removes every entry whose TTL ran out; returns how many."""
        num_expired = 0
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, worker_id, block_hash = heapq.heappop(heap)
            key = (worker_id, block_hash)
            if self._deadline.get(key) == deadline:  # else refreshed later, or the worker left
                del self._deadline[key]
                self._index.remove(worker_id, (block_hash,))
                num_expired += 1
        return num_expired

    def drop_worker(self, worker_id: str) -> None:
        """Forgets the worker's entries (their heap items die lazily)."""
        for key in [key for key in self._deadline if key[0] == worker_id]:
            del self._deadline[key]
        self._index.drop_worker(worker_id)
