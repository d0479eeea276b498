"""Real processes: control-plane replicas and workers SIGKILLed, etcd restarted."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from splitserve.control_plane.cluster_store import read_leader
from splitserve.control_plane.etcd_client import connect
from splitserve.control_plane.shard_spec import Role
from tests.control_plane.helpers import (
    SPEC,
    TTL_S,
    TopologyWatcher,
    cp_config,
    get_topology,
    make_worker,
    running_control_plane,
    wait_serving,
)
from tests.fixtures.etcd import free_port

WORKER_SCRIPT = Path(__file__).with_name("worker_process.py")


def spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def spawn_control_plane(endpoint, keys, replica_id: str) -> tuple[subprocess.Popen, str]:
    address = f"127.0.0.1:{free_port()}"
    process = spawn([
        "-m", "splitserve.control_plane", "--etcd", endpoint, "--inference-shards", SPEC, "--listen", address,
        "--cluster", keys.cluster, "--key-prefix", keys.prefix, "--lease-ttl", str(TTL_S),
        "--replica-id", replica_id, "--grace-period", "0.5", "--log-level", "WARNING",
    ])  # fmt: skip
    return process, address


async def leader_of(client, keys, timeout_s: float, *, not_id: str | None = None):
    """The leader record once one other than `not_id` holds the key."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        leader, _ = await read_leader(client, keys)
        if leader is not None and leader.replica_id != not_id:
            return leader
        await asyncio.sleep(0.05)
    pytest.fail(f"no leader (other than {not_id}) within {timeout_s} s")


def finish(process: subprocess.Popen, timeout_s: float = 10) -> tuple[int, str]:
    output, _ = process.communicate(timeout=timeout_s)
    return process.returncode, output


async def test_sigkilled_leader_is_replaced_by_the_standby(etcd_server, cluster_keys):
    first, first_address = spawn_control_plane(etcd_server.endpoint, cluster_keys, "cp-a")
    async with connect(etcd_server.endpoint) as client:
        try:
            leader = await leader_of(client, cluster_keys, 15)
            assert (leader.replica_id, leader.address) == ("cp-a", first_address)
            second, second_address = spawn_control_plane(etcd_server.endpoint, cluster_keys, "cp-b")
            worker = make_worker(etcd_server.endpoint, cluster_keys, 0, Role.DECODE)
            assert (await worker.start(timeout_s=15)).slot_ids == (2,)
            await wait_serving(second_address, 15)
            assert (await get_topology(second_address)).leader.replica_id == "cp-a"  # b is up, following

            first.send_signal(signal.SIGKILL)
            start = time.monotonic()
            leader = await leader_of(client, cluster_keys, 2 * TTL_S, not_id="cp-a")
            assert leader.replica_id == "cp-b" and time.monotonic() - start < 2 * TTL_S
            assert (await get_topology(second_address)).occupants == (None, None, "w0", None)
            await worker.close()

            second.send_signal(signal.SIGTERM)  # graceful: resigns, exits 0
            returncode, output = await asyncio.to_thread(finish, second)
            assert returncode == 0, output
            assert await read_leader(client, cluster_keys) == (None, None)
        finally:
            for process in (first, second):
                if process.poll() is None:
                    process.kill()
                process.communicate()


async def test_sigkilled_worker_disappears_within_ttl_and_is_replaced(etcd_server, cluster_keys):
    endpoint = etcd_server.endpoint
    async with running_control_plane(cp_config(endpoint, cluster_keys)) as cp:
        watcher = TopologyWatcher(cp.address)
        worker = spawn([
            str(WORKER_SCRIPT), "--etcd", endpoint, "--cluster", cluster_keys.cluster, "--prefix",
            cluster_keys.prefix, "--worker-id", "proc-0", "--address", "127.0.0.1:7100", "--role", "prefill",
            "--ttl", str(TTL_S),
        ])  # fmt: skip
        try:
            line = await asyncio.wait_for(asyncio.to_thread(worker.stdout.readline), 15)
            assert line.strip() == "assigned 0"
            await watcher.wait_for(lambda t: t.occupants[0] == "proc-0", 2)
            os.kill(worker.pid, signal.SIGKILL)
            start = time.monotonic()
            await watcher.wait_for(lambda t: t.worker("proc-0") is None and t.occupants[0] is None, TTL_S + 2)
            assert time.monotonic() - start < TTL_S + 2
        finally:
            worker.kill()
            worker.communicate()
        replacement = make_worker(endpoint, cluster_keys, 1, Role.PREFILL)
        assert (await replacement.start(timeout_s=5)).slot_ids == (0,)
        await replacement.close()
        await watcher.close()


async def test_workers_survive_an_etcd_restart(own_etcd, cluster_keys):
    endpoint = own_etcd.endpoint
    async with running_control_plane(cp_config(endpoint, cluster_keys)) as cp:
        workers = [make_worker(endpoint, cluster_keys, i, Role.DECODE) for i in range(2)]
        for worker in workers:
            await worker.start(timeout_s=5)
        await asyncio.to_thread(own_etcd.stop)
        await asyncio.sleep(TTL_S + 1)  # longer than a lease: only etcd's own bookkeeping can save them
        await asyncio.to_thread(own_etcd.start)
        watcher = TopologyWatcher(cp.address)
        topology = await watcher.wait_for(lambda t: t.occupants == (None, None, "w0", "w1"), 10)
        # Still registered on the leases they had, or re-registered into the same slots.
        assert {w.worker_id for w in topology.workers} == {"w0", "w1"}
        await asyncio.sleep(TTL_S + 0.5)  # and they stay: keepalives flow again
        # (read through the watcher, which retries: right after a restart the control
        # plane's etcd channel may still be reconnecting)
        topology = await watcher.wait_for(lambda t: t.occupants == (None, None, "w0", "w1"), 10)
        assert {w.worker_id for w in topology.workers} == {"w0", "w1"}
        await watcher.close()
        for worker in workers:
            await worker.close()
