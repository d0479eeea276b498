"""64 simulated workers with KV events on: the router's index and choices match the workers' real caches."""

from __future__ import annotations

import asyncio
import random

from splitserve.control_plane.shard_spec import Role
from splitserve.engine.block_hash import hash_blocks
from splitserve.engine.block_pool import BlockPool
from splitserve.engine.kv_events import KVEventPublisher
from splitserve.router.cluster_view import ClusterView, _tiebreak
from splitserve.router.kv_events import KVEventSubscriber
from splitserve.router.policy import PolicyConfig, route
from splitserve.router.snapshot import Snapshot, WorkerState
from splitserve.router.worker_client import GrpcWorkerClient
from splitserve.router.workers import WorkerEndpoint
from tests.router.router_doubles import DecodeDouble, PrefillDouble, serving

BS = 4
NUM_WORKERS = 64


def _cache(pool: BlockPool, hashes: list[bytes]) -> None:
    """Leaves the blocks of `hashes` cached in `pool`, as a finished request would."""
    hits = pool.lookup(hashes)
    pool.ref(hits)
    fresh = pool.allocate(len(hashes) - len(hits))
    for position in range(len(hits), len(hashes)):
        parent = hashes[position - 1] if position else None
        pool.register(fresh[position - len(hits)], hashes[position], parent)
    pool.free(list(reversed(hits + fresh)))


async def test_64_workers_index_and_decisions_match_ground_truth():
    rng = random.Random(5)
    ids = [f"{'p' if n % 2 == 0 else 'd'}{n:02d}" for n in range(NUM_WORKERS)]
    pools = {worker_id: BlockPool(num_blocks=64) for worker_id in ids}
    publishers = {worker_id: KVEventPublisher(worker_id, BS) for worker_id in ids}
    doubles = [PrefillDouble(i) if i.startswith("p") else DecodeDouble(i) for i in ids]
    for double in doubles:
        pool, publisher = pools[double.worker_id], publishers[double.worker_id]
        double.block_set_source = lambda pool=pool, publisher=publisher: publisher.block_set(pool.cached_hashes())
    # Prompts share system prefixes, so several workers hold overlapping prefixes.
    systems = [[rng.randrange(1000) for _ in range(8)] for _ in range(6)]
    prompts = [rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.choice((4, 8, 12)))] for _ in range(60)]

    view = ClusterView(BS)
    client = GrpcWorkerClient()
    subscriber = KVEventSubscriber(view.index, lambda w: client.get_block_set(w, 5.0), BS)
    subscriber.start()
    view.uses_events = True
    view.on_workers_changed(subscriber.set_workers)
    try:
        async with serving(*doubles) as endpoints:
            view.set_workers({
                i: WorkerEndpoint(i, e.address, e.role, publishers[i].endpoint, BS, 1) for i, e in endpoints.items()
            })  # fmt: skip
            for worker_id in ids:
                await asyncio.wait_for(subscriber.wait_synced(worker_id), 10)
            for _ in range(3):  # rounds of traffic, some of it evicting
                for worker_id in ids:
                    for prompt in rng.sample(prompts, 3):
                        _cache(pools[worker_id], hash_blocks(prompt, BS))
                    publishers[worker_id].publish(pools[worker_id].drain_events())
                for worker_id in ids:
                    await asyncio.wait_for(subscriber.wait_synced(worker_id, publishers[worker_id].last_sequence), 10)

            config = PolicyConfig(policy="scored", routing_alpha=0.7)
            for prompt in prompts:
                hashes = hash_blocks(prompt, BS)
                truth = {i: n for i in ids if (n := len(pools[i].lookup(hashes)))}
                assert view.index.lookup(hashes) == truth
                expected = Snapshot(
                    len(prompt), BS,
                    prefill=tuple(WorkerState(i, truth.get(i, 0), tiebreak=_tiebreak(hashes[0], i)) for i in ids if i.startswith("p")),
                    decode=tuple(WorkerState(i, truth.get(i, 0), tiebreak=_tiebreak(hashes[0], i)) for i in ids if i.startswith("d")),
                )  # fmt: skip
                assert route(view.snapshot(hashes, len(prompt)), config) == route(expected, config)
            assert all(subscriber.stats(i).num_gaps == 0 for i in ids)
            view.index.check_integrity()
            assert {w.role for w in view.workers.values()} == {Role.PREFILL, Role.DECODE}
    finally:
        await subscriber.close()
        await client.close()
        for publisher in publishers.values():
            publisher.close()
