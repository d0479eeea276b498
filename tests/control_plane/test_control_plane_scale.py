"""The issue's bar: 128 workers register and appear in the topology in < 10 s on a CPU machine."""

import asyncio
import time

from splitserve.control_plane.shard_spec import Role
from tests.control_plane.helpers import TopologyWatcher, cp_config, make_worker, running_control_plane

NUM_WORKERS = 128


async def test_128_workers_register_within_10_s(etcd_server, cluster_keys):
    endpoint = etcd_server.endpoint
    half = NUM_WORKERS // 2
    spec = f"role=prefill,tp=4,dp={half // 4}+role=decode,tp=2,dp={half // 2}"
    async with running_control_plane(cp_config(endpoint, cluster_keys, inference_shards=spec)) as cp:
        watcher = TopologyWatcher(cp.address)
        roles = [Role.PREFILL, Role.DECODE]
        workers = [make_worker(endpoint, cluster_keys, i, roles[i % 2]) for i in range(NUM_WORKERS)]
        start = time.monotonic()
        assignments = await asyncio.gather(*(worker.start(timeout_s=10) for worker in workers))
        topology = await watcher.wait_for(lambda t: not t.free_slot_ids(), 10)
        elapsed = time.monotonic() - start
        assert elapsed < 10, f"{NUM_WORKERS} workers took {elapsed:.1f} s"
        assert len(topology.workers) == NUM_WORKERS
        assert sorted(slot for a in assignments for slot in a.slot_ids) == list(range(NUM_WORKERS))
        assert all(a.role is roles[i % 2] for i, a in enumerate(assignments))
        await asyncio.gather(*(worker.close() for worker in workers))
        await watcher.close()
