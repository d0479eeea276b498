"""Which worker caches which KV blocks, indexed by the engines' chained block hashes.

    _holders:   block hash -> bitmask of worker slots holding it      (one entry per distinct block)
    _blocks_of: worker slot -> set of block hashes it holds           (for removal and resync)

Because a block hash names its whole prefix (engine/block_hash.py), the
cached prefix of a request on a worker is the longest run of the request's
hashes, from the first, that the worker holds. `lookup` finds it for every
worker at once by walking the request's hashes a single time and AND-ing
bitmasks:

    hashes   h0      h1      h2      h3
    holders  0b1011  0b0011  0b0001  0
    alive    0b1011  0b0011  0b0001  0      -> worker 3: 1 block, worker 1: 2, worker 0: 3

so a lookup costs O(blocks of the request) integer ANDs however many workers
and blocks the index holds. Memory is one dict entry per distinct block plus
one set entry per (worker, block). Not thread-safe: one event loop owns it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from splitserve.engine.block_hash import BlockHash


class PrefixIndex:
    """Per-worker sets of cached block hashes with a one-pass longest-prefix lookup."""

    def __init__(self) -> None:
        self._slot_of: dict[str, int] = {}
        self._worker_at: list[str | None] = []
        self._free_slots: list[int] = []
        self._holders: dict[BlockHash, int] = {}
        self._blocks_of: list[set[BlockHash]] = []

    # ----------------------------------------------------------------- queries
    @property
    def worker_ids(self) -> tuple[str, ...]:
        return tuple(sorted(self._slot_of))

    @property
    def num_distinct_blocks(self) -> int:
        return len(self._holders)

    def num_blocks(self, worker_id: str) -> int:
        slot = self._slot_of.get(worker_id)
        return 0 if slot is None else len(self._blocks_of[slot])

    def blocks_of(self, worker_id: str) -> frozenset[BlockHash]:
        slot = self._slot_of.get(worker_id)
        return frozenset() if slot is None else frozenset(self._blocks_of[slot])

    def holders(self, block_hash: BlockHash) -> frozenset[str]:
        return frozenset(self._workers_in(self._holders.get(block_hash, 0)))

    def lookup(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """worker id -> number of leading `block_hashes` it holds, for every worker holding the first one."""
        if not block_hashes:
            return {}
        holders = self._holders
        alive = holders.get(block_hashes[0], 0)
        depth_of: dict[str, int] = {}
        depth = 1
        while alive and depth < len(block_hashes):
            still = alive & holders.get(block_hashes[depth], 0)
            if still != alive:
                for worker_id in self._workers_in(alive & ~still):
                    depth_of[worker_id] = depth
                alive = still
            depth += 1
        for worker_id in self._workers_in(alive):
            depth_of[worker_id] = depth
        return depth_of

    # ---------------------------------------------------------------- mutation
    def add_worker(self, worker_id: str) -> None:
        """Makes `worker_id` known with no blocks (a no-op if it is known)."""
        self._slot(worker_id)

    def store(self, worker_id: str, block_hashes: Iterable[BlockHash]) -> None:
        """`worker_id` now caches these blocks (repeats are no-ops)."""
        slot = self._slot(worker_id)
        bit = 1 << slot
        mine = self._blocks_of[slot]
        holders = self._holders
        for block_hash in block_hashes:
            if block_hash not in mine:
                mine.add(block_hash)
                holders[block_hash] = holders.get(block_hash, 0) | bit

    def remove(self, worker_id: str, block_hashes: Iterable[BlockHash]) -> None:
        """`worker_id` no longer caches these blocks (unknown ones are ignored)."""
        slot = self._slot_of.get(worker_id)
        if slot is None:
            return
        mine = self._blocks_of[slot]
        for block_hash in block_hashes:
            if block_hash in mine:
                mine.discard(block_hash)
                self._unset(block_hash, slot)

    def clear(self, worker_id: str) -> None:
        """Forgets every block of `worker_id`; the worker stays known."""
        slot = self._slot_of.get(worker_id)
        if slot is None:
            return
        for block_hash in self._blocks_of[slot]:
            self._unset(block_hash, slot)
        self._blocks_of[slot] = set()

    def replace(self, worker_id: str, block_hashes: Iterable[BlockHash]) -> None:
        """Sets the worker's blocks to exactly `block_hashes` (a resync), touching only the difference."""
        wanted = set(block_hashes)
        current = self._blocks_of[self._slot(worker_id)]
        self.remove(worker_id, current - wanted)
        self.store(worker_id, wanted - current)

    def drop_worker(self, worker_id: str) -> None:
        """Forgets the worker and its blocks (it left the topology); its slot is reused."""
        if worker_id not in self._slot_of:
            return
        self.clear(worker_id)
        slot = self._slot_of.pop(worker_id)
        self._worker_at[slot] = None
        self._free_slots.append(slot)

    # --------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """AssertionError unless the hash -> workers map and the per-worker sets agree exactly."""
        expected: dict[BlockHash, int] = {}
        for slot, blocks in enumerate(self._blocks_of):
            if self._worker_at[slot] is None and blocks:
                raise AssertionError(f"free slot {slot} still holds {len(blocks)} blocks")
            for block_hash in blocks:
                expected[block_hash] = expected.get(block_hash, 0) | (1 << slot)
        if expected != self._holders:
            raise AssertionError(f"holder map has {len(self._holders)} entries, per-worker sets imply {len(expected)}")

    # --------------------------------------------------------------- internals
    def _slot(self, worker_id: str) -> int:
        slot = self._slot_of.get(worker_id)
        if slot is not None:
            return slot
        if not isinstance(worker_id, str) or not worker_id:
            raise ValueError(f"worker_id must be a non-empty string, got {worker_id!r}")
        if self._free_slots:
            slot = self._free_slots.pop()
            self._worker_at[slot] = worker_id
        else:
            slot = len(self._worker_at)
            self._worker_at.append(worker_id)
            self._blocks_of.append(set())
        self._slot_of[worker_id] = slot
        return slot

    def _unset(self, block_hash: BlockHash, slot: int) -> None:
        remaining = self._holders[block_hash] & ~(1 << slot)
        if remaining:
            self._holders[block_hash] = remaining
        else:
            del self._holders[block_hash]

    def _workers_in(self, mask: int) -> list[str]:
        workers = []
        while mask:
            low = mask & -mask
            workers.append(self._worker_at[low.bit_length() - 1])
            mask ^= low
        return workers
