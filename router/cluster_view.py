"""`ClusterView`: the router's picture of the cluster, and the `Snapshot` a policy decides on.

It joins three things, all owned by the router's event loop:

    workers   routable workers from the topology   (set_workers, on every WatchTopology snapshot)
    index     cached blocks per worker              (KV events, or RoutedPrefixes in approximate mode)
    load      requests in flight per worker         (LoadTracker)

Block size: every worker must hash with the router's block size, else its
prefix matches would silently be zero. `check_block_sizes` makes a
mismatch an error when the router starts; a mismatched worker that joins
later is not routed to (logged as an error).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence

from splitserve.control_plane.shard_spec import Role
from splitserve.engine.block_hash import BlockHash
from splitserve.router.approximate import RoutedPrefixes
from splitserve.router.load import LoadTracker
from splitserve.router.prefix_index import PrefixIndex
from splitserve.router.snapshot import Snapshot, WorkerState
from splitserve.router.suspects import SuspectList
from splitserve.router.workers import WorkerEndpoint

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16
"""The engine's default block_size_tokens: used when neither the router nor any worker names one."""


class BlockSizeMismatchError(ValueError):
    """A worker's KV block size differs from the router's (or workers disagree)."""


def check_block_sizes(workers: Mapping[str, WorkerEndpoint], block_size: int | None) -> int:
    """The block size to route with: `block_size`, else the one every worker advertises.

    Raises BlockSizeMismatchError naming the first worker that disagrees.
    """
    advertised = sorted((w.worker_id, w.kv_block_size) for w in workers.values() if w.kv_block_size is not None)
    expected = block_size if block_size is not None else (advertised[0][1] if advertised else None)
    for worker_id, size in advertised:
        if size != expected:
            source = "the router's --block-size" if block_size is not None else f"worker {advertised[0][0]!r}'s"
            raise BlockSizeMismatchError(
                f"worker {worker_id!r} uses KV block size {size!r} but {source} is {expected!r}"
            )
    if expected is None:
        log.warning("no KV block size given or advertised; assuming %d", DEFAULT_BLOCK_SIZE)
        return DEFAULT_BLOCK_SIZE
    return expected


class ClusterView:
    """Routable workers + prefix index + load, turned into per-request snapshots."""

    def __init__(
        self,
        block_size: int,
        *,
        max_running_per_worker: int = 256,
        approximate_ttl_s: float | None = None,
        suspect_cooldown_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`approximate_ttl_s`: index routed prompts with this TTL for workers that publish no
        KV events (all of them when the subscriber is off); None = never. `suspect_cooldown_s`:
        how long a worker whose call failed at the transport level is skipped (0 = never)."""
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self.max_running_per_worker = max_running_per_worker
        self.index = PrefixIndex()
        self.load = LoadTracker()
        self.routed = None if approximate_ttl_s is None else RoutedPrefixes(self.index, approximate_ttl_s)
        self.suspects = SuspectList(suspect_cooldown_s, clock)
        """Workers that just failed a call (UNAVAILABLE / DEADLINE_EXCEEDED): skipped for a while."""
        self.uses_events = False
        """Set by the KV-event subscriber: workers with an endpoint are then indexed from their events."""
        self._clock = clock
        self._workers: dict[str, WorkerEndpoint] = {}
        self._rejected: set[str] = set()
        self._listeners: list[Callable[[Mapping[str, WorkerEndpoint]], None]] = []

    @property
    def workers(self) -> Mapping[str, WorkerEndpoint]:
        return self._workers

    def worker(self, worker_id: str) -> WorkerEndpoint | None:
        return self._workers.get(worker_id)

    def on_workers_changed(self, listener: Callable[[Mapping[str, WorkerEndpoint]], None]) -> None:
        """Calls `listener(workers)` after every set_workers (the KV-event subscriber follows it)."""
        self._listeners.append(listener)

    def set_workers(self, workers: Mapping[str, WorkerEndpoint]) -> None:
        """Replaces the routable workers; the ones that left lose their index entries and reports."""
        accepted = {}
        for worker_id, worker in workers.items():
            if worker.kv_block_size is not None and worker.kv_block_size != self.block_size:
                if worker_id not in self._rejected:
                    log.error(
                        "not routing to worker %r: its KV block size %r differs from the router's %r "
                        "(give every worker and the router the same --block-size)",
                        worker_id, worker.kv_block_size, self.block_size,
                    )  # fmt: skip
                self._rejected.add(worker_id)
                continue
            self._rejected.discard(worker_id)
            accepted[worker_id] = worker
        for worker_id, worker in accepted.items():
            old = self._workers.get(worker_id)
            if old is not None and old.lease_id != worker.lease_id:  # re-registered: a new or resumed process
                self.suspects.forgive(worker_id)
        for worker_id in self._workers.keys() - accepted.keys():
            self.suspects.forgive(worker_id)
            self.index.drop_worker(worker_id)
            if self.routed is not None:
                self.routed.drop_worker(worker_id)
            self.load.forget(worker_id)
        self._workers = accepted
        for listener in self._listeners:
            listener(accepted)

    def snapshot(self, block_hashes: Sequence[BlockHash], prompt_len: int, exclude: frozenset[str] = frozenset()) -> Snapshot:
        """The policy's input for a prompt with these block hashes; `exclude` = workers that already
        failed this request. Suspects are left out too, unless that would leave out their whole role."""
        if self.routed is not None:
            self.routed.expire(self._clock())
        depths = self.index.lookup(block_hashes)
        first = block_hashes[0] if block_hashes else b""
        pools: dict[Role, list[WorkerState]] = {Role.PREFILL: [], Role.DECODE: []}
        candidates = {w: worker for w, worker in self._workers.items() if not worker.is_draining and w not in exclude}
        suspects = self.suspects.current()
        healthy_roles = {worker.role for w, worker in candidates.items() if w not in suspects}
        for worker_id, worker in candidates.items():
            if worker_id in suspects and worker.role in healthy_roles:
                continue
            pools[worker.role].append(
                WorkerState(
                    worker_id, depths.get(worker_id, 0), self.load.num_running(worker_id),
                    self.max_running_per_worker, self.load.kv_usage(worker_id), _tiebreak(first, worker_id),
                )  # fmt: skip
            )
        return Snapshot(prompt_len, self.block_size, tuple(pools[Role.PREFILL]), tuple(pools[Role.DECODE]))

    def record_routed(self, worker_id: str, block_hashes: Sequence[BlockHash]) -> None:
        """`worker_id` is now computing (or importing) these blocks: index them if no events will."""
        worker = self._workers.get(worker_id)
        if self.routed is None or worker is None or not block_hashes:
            return
        if self.uses_events and worker.kv_events_endpoint is not None:
            return
        self.routed.record(worker_id, block_hashes, self._clock())


def _tiebreak(first_block: bytes | int, worker_id: str) -> int:
    if first_block == b"":
        return 0
    key = first_block if isinstance(first_block, bytes) else str(first_block).encode()
    return int.from_bytes(hashlib.blake2b(key + b"|" + worker_id.encode(), digest_size=8).digest(), "little")
