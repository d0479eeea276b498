"""Leases and leader election against a real etcd."""

import asyncio
import time

import pytest

from splitserve.control_plane.cluster_store import ClusterStore
from splitserve.control_plane.election import LeaderElection
from splitserve.control_plane.errors import NotLeaderError
from splitserve.control_plane.etcd_client import connect, parse_endpoint
from splitserve.control_plane.lifecycle import LifecycleState, LifecycleStatus
from splitserve.control_plane.records import LeaderRecord
from splitserve.control_plane.registry import LeaseKeeper
from splitserve.control_plane.shard_spec import parse_inference_shards

TTL_S = 2


async def wait_until(predicate, timeout_s: float, interval_s: float = 0.05) -> float:
    """Seconds until `await predicate()` is true; fails the test after `timeout_s`."""
    start = time.monotonic()
    while not await predicate():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"condition not met within {timeout_s} s")
        await asyncio.sleep(interval_s)
    return time.monotonic() - start


def test_parse_endpoint():
    assert parse_endpoint("127.0.0.1:2379") == ("127.0.0.1", 2379)
    assert parse_endpoint("http://etcd:1") == ("etcd", 1)
    with pytest.raises(ValueError, match="etcd endpoint must be host:port, got 'etcd'"):
        parse_endpoint("etcd")


async def test_keepalive_outlives_the_ttl_and_a_crash_expires_the_keys(etcd_server, cluster_keys):
    async with connect(etcd_server.endpoint) as client:
        keeper = LeaseKeeper(client, ttl_s=TTL_S)
        lease_id = await keeper.start()
        key = cluster_keys.worker("w")
        await client.put(key, b"x", lease=lease_id)
        await asyncio.sleep(TTL_S * 1.5)
        assert (await client.get(key)).lease == lease_id
        await keeper.close(revoke=False)  # the process "dies": no more refreshes, no revoke

        async def gone():
            return await client.get(key) is None

        assert await wait_until(gone, TTL_S + 2) < TTL_S + 1


async def test_a_revoked_lease_is_reported_lost(etcd_server):
    async with connect(etcd_server.endpoint) as client:
        keeper = LeaseKeeper(client, ttl_s=3)
        await keeper.start()
        await client.revoke_lease(keeper.lease_id)
        await asyncio.wait_for(keeper.lost.wait(), 2)
        await keeper.close()


async def test_one_leader_and_a_standby_takes_over_when_it_dies(etcd_server, cluster_keys):
    records = [LeaderRecord(f"cp-{i}", f"127.0.0.1:{9000 + i}") for i in range(3)]
    clients = [connect(etcd_server.endpoint) for _ in records]
    first, second, third = (LeaderElection(c, cluster_keys, r, TTL_S) for c, r in zip(clients, records, strict=True))
    await first.start()
    await asyncio.wait_for(first.wait_until_leader(), 2)
    await second.start()
    await asyncio.sleep(0.3)
    assert (first.is_leader, second.is_leader) == (True, False)
    with pytest.raises(NotLeaderError) as info:
        second.fence()
    assert info.value.leader == records[0]
    assert "the leader is cp-0 at 127.0.0.1:9000" in str(info.value)
    stale_fence = first.fence()

    # The leader freezes: its lease runs out, the standby campaigns and wins.
    await first.close(resign=False)
    start = time.monotonic()
    await asyncio.wait_for(second.wait_until_leader(), 2 * TTL_S)
    assert time.monotonic() - start < 2 * TTL_S
    assert second.fence() > stale_fence

    # A write fenced with the deposed leader's token fails; the new leader's lands.
    store = ClusterStore(clients[0], cluster_keys, parse_inference_shards("role=decode"))
    paused = LifecycleStatus(LifecycleState.PAUSED)
    assert await store.write_lifecycle(paused, 0, stale_fence) is None
    assert await store.write_lifecycle(paused, 0, second.fence()) is not None

    # Resigning hands over at once rather than after a TTL.
    await third.start()
    await asyncio.sleep(0.2)
    start = time.monotonic()
    await second.close()
    await asyncio.wait_for(third.wait_until_leader(), 1.5)
    assert time.monotonic() - start < 1.0
    assert (await store.read_leader())[0] == records[2]
    await third.close()
    assert (await store.read_leader()) == (None, None)
    for client in clients:
        await client.close()


async def test_close_returns_in_bounded_time_while_etcd_hangs(etcd_server, cluster_keys):
    """A frozen etcd (SIGSTOP: connections stay open, nothing answers) must not hang a shutdown:
    the campaign's cleanup and the lease revocation each give up after their bound."""
    import os
    import signal

    from splitserve.control_plane.election import STOP_TIMEOUT_S

    client = connect(etcd_server.endpoint)
    election = LeaderElection(client, cluster_keys, LeaderRecord("cp-frozen", "127.0.0.1:9100"), TTL_S)
    await election.start()
    await asyncio.wait_for(election.wait_until_leader(), 2)
    pid = etcd_server._process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        await asyncio.wait_for(election.close(), 2 * STOP_TIMEOUT_S + 5)
        took = time.monotonic() - start
    finally:
        os.kill(pid, signal.SIGCONT)
    assert took < STOP_TIMEOUT_S + 2.0 + 1.0  # campaign stop + revoke (2 s) + slack
    assert not election.is_leader
    await client.close()
