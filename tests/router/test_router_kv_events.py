"""KV events over real ZMQ sockets: engine publisher -> router subscriber -> prefix index.

The workers' caches are real BlockPools; resyncs call GetBlockSet on real
gRPC servers (the protocol doubles of router_doubles.py answering from the
live pool through KVEventPublisher.block_set, as the real workers must).
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from splitserve.engine.block_hash import hash_blocks
from splitserve.engine.block_pool import BlockEvent, BlockPool
from splitserve.engine.kv_events import KVEventPublisher, encode_events
from splitserve.router.kv_events import KVEventSubscriber
from splitserve.router.messages import AllBlocksCleared, BlocksRemoved, BlocksStored
from splitserve.router.prefix_index import PrefixIndex
from splitserve.router.service import kv_events_from_bytes
from splitserve.router.worker_client import GrpcWorkerClient
from splitserve.router.workers import WorkerEndpoint
from tests.router.router_doubles import DecodeDouble, PrefillDouble, serving

BS = 4
_prompt_numbers = itertools.count(1)


def cache_prompt(pool: BlockPool, num_blocks: int = 3) -> list[bytes]:
    """Computes a fresh prompt's blocks in `pool` and leaves them cached (as a finished request does)."""
    base = next(_prompt_numbers) * 1000
    hashes = hash_blocks([base + i for i in range(num_blocks * BS)], BS)
    block_ids = pool.allocate(num_blocks)
    for position, (block_id, block_hash) in enumerate(zip(block_ids, hashes, strict=True)):
        pool.register(block_id, block_hash, hashes[position - 1] if position else None)
    pool.free(reversed(block_ids))
    return hashes


def test_encode_events_chains_consecutive_stored_blocks():
    h = hash_blocks(list(range(12)), BS)
    other = hash_blocks([7] * 4, BS)
    events = [
        BlockEvent("stored", (h[0],), None), BlockEvent("stored", (h[1],), h[0]), BlockEvent("stored", (h[2],), h[1]),
        BlockEvent("stored", (other[0],), None), BlockEvent("removed", (h[2],)), BlockEvent("cleared"),
    ]  # fmt: skip
    decoded = kv_events_from_bytes(encode_events(events, BS).SerializeToString())
    assert decoded == (
        BlocksStored((h[0], h[1], h[2]), None, BS),
        BlocksStored((other[0],), None, BS),
        BlocksRemoved((h[2],)),
        AllBlocksCleared(),
    )


class _Worker:
    def __init__(self, worker_id: str, block_size: int = BS) -> None:
        self.pool = BlockPool(num_blocks=12)
        self.publisher = KVEventPublisher(worker_id, block_size=block_size)
        self.double = PrefillDouble(worker_id) if worker_id.startswith("p") else DecodeDouble(worker_id)
        self.double.block_set_source = lambda: self.publisher.block_set(self.pool.cached_hashes())

    def publish(self) -> None:
        self.publisher.publish(self.pool.drain_events())

    def endpoint(self, endpoints: dict[str, WorkerEndpoint], lease_id: int = 1) -> WorkerEndpoint:
        grpc_endpoint = endpoints[self.double.worker_id]
        return WorkerEndpoint(
            grpc_endpoint.worker_id, grpc_endpoint.address, grpc_endpoint.role, self.publisher.endpoint,
            self.publisher.block_size, lease_id,
        )  # fmt: skip


async def _synced(subscriber: KVEventSubscriber, worker: _Worker) -> None:
    await asyncio.wait_for(subscriber.wait_synced(worker.double.worker_id, worker.publisher.last_sequence), 5)


async def _until_live(subscriber: KVEventSubscriber, worker: _Worker) -> None:
    """ZMQ drops what is published before a subscription reaches the publisher: publish until one arrives."""
    worker_id = worker.double.worker_id
    while subscriber.stats(worker_id).num_messages == 0:
        cache_prompt(worker.pool, 1)
        worker.publish()
        await asyncio.sleep(0.05)
    await _synced(subscriber, worker)


async def test_events_gaps_resync_and_removal_over_real_sockets():
    prefill, decode = _Worker("p0"), _Worker("d0")
    index, client = PrefixIndex(), GrpcWorkerClient()
    subscriber = KVEventSubscriber(index, lambda worker: client.get_block_set(worker, 2.0), BS)
    subscriber.start()
    try:
        async with serving(prefill.double, decode.double) as endpoints:
            # Published before anyone subscribed: only the first GetBlockSet can bring these in.
            early = cache_prompt(prefill.pool)
            prefill.publish()
            subscriber.set_workers({"p0": prefill.endpoint(endpoints), "d0": decode.endpoint(endpoints)})
            await _synced(subscriber, prefill)
            assert set(early) <= index.blocks_of("p0")
            assert subscriber.stats("p0").num_resyncs == 1 and prefill.double.num_block_set_calls == 1
            await _until_live(subscriber, prefill)
            await _until_live(subscriber, decode)
            base = subscriber.stats("p0")

            # Live stored events, on both workers, each under its own id.
            stored = cache_prompt(prefill.pool)
            decode_stored = cache_prompt(decode.pool, 2)
            prefill.publish()
            decode.publish()
            await _synced(subscriber, prefill)
            await _synced(subscriber, decode)
            assert index.blocks_of("p0") == set(prefill.pool.cached_hashes())
            assert index.blocks_of("d0") == set(decode.pool.cached_hashes())
            assert index.lookup(stored) == {"p0": 3} and index.lookup(decode_stored) == {"d0": 2}

            # Removed events: filling the pool evicts cached blocks (LRU).
            prefill.pool.free(prefill.pool.allocate(10))
            prefill.publish()
            await _synced(subscriber, prefill)
            assert index.blocks_of("p0") == set(prefill.pool.cached_hashes())
            assert set(early).isdisjoint(index.blocks_of("p0"))

            # A message lost on the wire: its sequence number is used up, the subscriber never sees it.
            lost = cache_prompt(prefill.pool, 2)
            prefill.pool.drain_events()
            prefill.publisher.last_sequence += 1
            after = cache_prompt(prefill.pool, 1)
            prefill.publish()
            await _synced(subscriber, prefill)
            stats = subscriber.stats("p0")
            assert (stats.num_gaps, stats.num_resyncs) == (base.num_gaps + 1, base.num_resyncs + 1)
            assert prefill.double.num_block_set_calls == 1 + (stats.num_resyncs - 1)
            assert index.blocks_of("p0") == set(prefill.pool.cached_hashes())
            assert index.lookup(lost) == {"p0": 2} and index.lookup(after) == {"p0": 1}

            # Cleared: the pool forgets every idle cached block.
            prefill.pool.reset_prefix_cache()
            prefill.publish()
            await _synced(subscriber, prefill)
            assert index.blocks_of("p0") == frozenset() == set(prefill.pool.cached_hashes())
            assert subscriber.stats("p0").num_gaps == stats.num_gaps

            # Leaving the topology drops the worker's blocks; the other stays.
            subscriber.set_workers({"d0": decode.endpoint(endpoints)})
            assert index.worker_ids == ("d0",)
            assert index.blocks_of("d0") == set(decode.pool.cached_hashes())
            index.check_integrity()

            # A restarted worker (new lease) starts a fresh stream: blocks dropped, then resynced.
            subscriber.set_workers({"d0": decode.endpoint(endpoints, lease_id=2)})
            await _synced(subscriber, decode)
            assert subscriber.stats("d0").num_resyncs == 1
            assert index.blocks_of("d0") == set(decode.pool.cached_hashes())
    finally:
        await subscriber.close()
        await client.close()
        prefill.publisher.close()
        decode.publisher.close()


async def test_a_worker_with_another_block_size_is_not_indexed():
    worker = _Worker("p0", block_size=8)
    index, client = PrefixIndex(), GrpcWorkerClient()
    subscriber = KVEventSubscriber(index, lambda w: client.get_block_set(w, 2.0), BS)
    subscriber.start()
    try:
        async with serving(worker.double) as endpoints:
            cache_prompt(worker.pool)
            worker.publish()
            subscriber.set_workers({"p0": worker.endpoint(endpoints)})
            await _synced(subscriber, worker)
            assert index.blocks_of("p0") == frozenset()
    finally:
        await subscriber.close()
        await client.close()
        worker.publisher.close()


def test_publisher_binds_loopback_and_rejects_bad_arguments():
    publisher = KVEventPublisher("w", block_size=16)
    try:
        assert publisher.endpoint.startswith("tcp://127.0.0.1:") and not publisher.endpoint.endswith(":0")
        publisher.publish([])
        assert publisher.last_sequence == 0
        publisher.publish([BlockEvent("cleared")])  # nobody subscribed: dropped by ZMQ, never blocks
        assert publisher.last_sequence == 1
        reply = publisher.block_set([b"x" * 16])
        assert (list(reply.block_digests), reply.block_size, reply.event_sequence) == ([b"x" * 16], 16, 1)
    finally:
        publisher.close()
    with pytest.raises(ValueError, match="''"):
        KVEventPublisher("", block_size=4)
    with pytest.raises(ValueError, match="got 0"):
        KVEventPublisher("w", block_size=0)
