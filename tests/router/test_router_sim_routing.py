"""The router's choices with 64 simulated workers and KV events on: a real etcd, a real
control plane, a real `splitserve router` process (longest_prefix) and 32 prefill + 32
decode `serve_worker`s with SimEngine in 2 host processes (tests/control_plane/sim_worker_host.py).

1. Prefixes warmed directly on chosen prefill workers (not the lowest ids): the workers'
   BlockStored events reach the router, and every later request sharing a prefix is
   prefilled on exactly the worker that holds it, which reports the cached tokens.
2. Prefixes first sent through the router land somewhere; every later request sharing
   one lands on that same worker.
"""

import asyncio
import contextlib
import os
import sys
import uuid

import grpc

from splitserve.control_plane.keys import ClusterKeys
from splitserve.control_plane.shard_spec import Role
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.wire import sampling_to_proto
from splitserve.proto.v1 import router_pb2, router_pb2_grpc
from tests.control_plane.helpers import TopologyWatcher, cp_config, running_control_plane, wait_serving
from tests.control_plane.test_sim_scale import SimHost, distinct_free_ports, wait_all

NUM_WORKERS = 64
NUM_HOSTS = 2
BLOCK = 16  # serve_worker's default KV block size
PREFIX_BLOCKS = 4
PARAMS = sampling_to_proto(SamplingParams(num_tokens_to_generate=4, temperature=0.0))


def prompt(prefix: int, suffix: int) -> list[int]:
    """PREFIX_BLOCKS full blocks shared by every prompt of `prefix`, then a suffix of its own."""
    head = [1000 + 97 * prefix + i for i in range(PREFIX_BLOCKS * BLOCK)]
    return head + [50_000 + 13 * suffix + i for i in range(BLOCK // 2)]


async def generate(router: str, request_id: str, token_ids: list[int]) -> router_pb2.GenerateChunk:
    async with grpc.aio.insecure_channel(router) as channel:
        request = router_pb2.GenerateRequest(
            request_id=request_id, token_ids=token_ids, sampling_params=PARAMS
        )
        last = None
        async for chunk in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=20):
            last = chunk
    return last


async def test_64_sim_workers_requests_land_on_the_prefix_holder(router_etcd):
    keys = ClusterKeys(cluster=f"sim-route-{uuid.uuid4().hex[:6]}")
    half = NUM_WORKERS // 2
    config = cp_config(
        router_etcd.endpoint, keys, inference_shards=f"role=prefill,dp={half}+role=decode,dp={half}"
    )
    async with running_control_plane(config) as cp:
        watcher = TopologyWatcher(cp.address)
        roles = ["prefill"] * half + ["decode"] * half
        ports = [0] * NUM_WORKERS  # each worker binds a kernel-chosen port and reports it (READY)
        hosts = [
            await SimHost.spawn(router_etcd.endpoint, keys.cluster, roles[i::NUM_HOSTS], ports[i::NUM_HOSTS])
            for i in range(NUM_HOSTS)
        ]
        router = None
        try:
            await wait_all(hosts, "loaded", 60)
            for host in hosts:
                host.go()
            topology = await watcher.wait_for(
                lambda t: len(t.workers) == NUM_WORKERS and not t.free_slot_ids(), 30
            )
            await wait_all(hosts, "all_ready", 30)
            # Only now: a port picked before the 64 workers bound theirs could be taken by one, and
            # gRPC's SO_REUSEPORT would let the router listen beside it (calls then hit the worker).
            router_address = f"127.0.0.1:{distinct_free_ports(1)[0]}"
            router = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "splitserve", "router", "--control-plane", cp.address, "--listen", router_address,
                "--policy", "longest_prefix", "--block-size", str(BLOCK), "--kv-events", "--log-level", "WARNING",
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
                env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"),
            )  # fmt: skip
            await wait_serving(router_address, 30)
            prefill = sorted(
                (w for w in topology.workers if w.record.role is Role.PREFILL), key=lambda w: w.worker_id
            )
            decode = next(w for w in topology.workers if w.record.role is Role.DECODE)
            assert len(prefill) == half

            # The event pipeline is live: a canary prefix warmed on one worker is predicted by the router.
            canary = prefill[-1]
            await one_disaggregated_request_with(canary.address, decode.address, prompt(99, 0))
            for attempt in range(100):
                chunk = await generate(router_address, f"canary-{attempt}", prompt(99, attempt + 1))
                if chunk.routing.predicted_cached_tokens >= PREFIX_BLOCKS * BLOCK:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the router never indexed the canary prefix from KV events")

            # 1. Warm K prefixes on chosen workers (never the lowest id, which ties would pick).
            holders = {k: prefill[3 + 7 * k] for k in range(4)}
            for k, worker in holders.items():
                await one_disaggregated_request_with(worker.address, decode.address, prompt(k, 0))
            await asyncio.sleep(1.0)  # the BlockStored events travel over ZMQ
            for round_ in range(3):
                for k, worker in holders.items():
                    chunk = await generate(router_address, f"warm-{k}-{round_}", prompt(k, round_ + 1))
                    assert chunk.routing.prefill_worker_id == worker.worker_id, (k, round_, chunk.routing)
                    assert chunk.routing.predicted_cached_tokens == PREFIX_BLOCKS * BLOCK
                    assert chunk.usage.cached_tokens >= PREFIX_BLOCKS * BLOCK

            # 2. New prefixes through the router: the first lands somewhere, the rest follow it.
            first = {}
            for k in range(10, 14):
                chunk = await generate(router_address, f"new-{k}", prompt(k, 0))
                first[k] = chunk.routing.prefill_worker_id
                assert first[k] in {w.worker_id for w in prefill}
            await asyncio.sleep(1.0)
            for round_ in range(2):
                for k, worker_id in first.items():
                    chunk = await generate(router_address, f"new-{k}-{round_}", prompt(k, round_ + 1))
                    assert chunk.routing.prefill_worker_id == worker_id, (k, round_, chunk.routing)
                    assert chunk.routing.predicted_cached_tokens == PREFIX_BLOCKS * BLOCK
        finally:
            if router is not None:
                with contextlib.suppress(ProcessLookupError):
                    router.terminate()
                try:
                    await asyncio.wait_for(router.wait(), 20)
                except TimeoutError:
                    router.kill()
                    await router.wait()
            codes = await asyncio.gather(*(h.stop() for h in hosts))
            await watcher.close()
        assert codes == [0] * NUM_HOSTS, "\n".join("".join(h.log[-20:]) for h in hosts)


async def one_disaggregated_request_with(
    prefill_address: str, decode_address: str, token_ids: list[int]
) -> None:
    """Prefill on `prefill_address` (it caches the prompt's blocks), hand off to `decode_address`."""
    from splitserve.proto.v1 import (
        decode_worker_pb2,
        decode_worker_pb2_grpc,
        prefill_worker_pb2,
        prefill_worker_pb2_grpc,
    )

    async with (
        grpc.aio.insecure_channel(prefill_address) as pc,
        grpc.aio.insecure_channel(decode_address) as dc,
    ):
        rid = f"warm-{uuid.uuid4().hex[:8]}"
        request = prefill_worker_pb2.PrefillRequest(
            request_id=rid, token_ids=token_ids, sampling_params=PARAMS
        )
        response = await prefill_worker_pb2_grpc.PrefillWorkerStub(pc).Prefill(request, timeout=10)
        decode_request = decode_worker_pb2.DecodeRequest(
            request_id=rid, token_ids=token_ids, sampling_params=PARAMS, handoff=response.handoff,
            prefill_address=prefill_address,
        )  # fmt: skip
        async for _ in decode_worker_pb2_grpc.DecodeWorkerStub(dc).Decode(decode_request, timeout=10):
            pass
