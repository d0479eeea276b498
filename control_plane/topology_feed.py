"""The latest topology of the cluster, followed through one etcd watch per control-plane process.

Every WatchTopology stream waits on this feed instead of opening its own
etcd watch. A change re-reads the whole cluster prefix (a few hundred keys
for 128 workers) rather than patching a snapshot event by event: simpler to
trust, and a burst of events costs one read, because events at or below the
revision just read are skipped. A slow stream reader likewise skips to the
newest snapshot instead of queueing old ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aetcd

from splitserve.control_plane.cluster_store import ClusterStore
from splitserve.control_plane.topology import Topology

log = logging.getLogger(__name__)


class TopologyFeed:
    """Publishes a new Topology after every etcd change under the cluster root."""

    def __init__(self, store: ClusterStore) -> None:
        self._store = store
        self._latest: Topology | None = None
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._is_closed = False

    @property
    def latest(self) -> Topology | None:
        return self._latest

    async def start(self) -> Topology:
        """Reads the first snapshot (etcd must be reachable) and starts following changes."""
        first = await self._store.read_topology()
        await self._publish(first)
        self._task = asyncio.create_task(self._follow(), name="topology-feed")
        return first

    async def next_after(self, revision: int) -> Topology | None:
        """The latest snapshot once it is newer than `revision`; None once the feed is closed."""
        async with self._changed:
            await self._changed.wait_for(
                lambda: self._is_closed or (self._latest is not None and self._latest.revision > revision)
            )
            return None if self._is_closed else self._latest

    async def close(self) -> None:
        """Stops following and ends every waiting next_after() with None."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        async with self._changed:
            self._is_closed = True
            self._changed.notify_all()

    async def _publish(self, topology: Topology) -> None:
        async with self._changed:
            if self._latest is None or topology.revision > self._latest.revision:
                self._latest = topology
                self._changed.notify_all()

    async def _follow(self) -> None:
        is_failing = False
        while True:
            try:
                await self._publish(await self._store.read_topology())
                is_failing = False
                watch = await self._store.watch(self._latest.revision + 1)
                try:
                    async for event in watch:
                        if event.kv.mod_revision > self._latest.revision:
                            await self._publish(await self._store.read_topology())
                finally:
                    with contextlib.suppress(aetcd.ClientError):
                        await watch.cancel()
            except (TimeoutError, aetcd.ClientError) as e:
                # Warn once per outage, not every retry.
                log.log(logging.DEBUG if is_failing else logging.WARNING, "topology watch failed (%s); retrying", e)
                is_failing = True
                await asyncio.sleep(0.5)
