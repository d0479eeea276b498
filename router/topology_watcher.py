"""`TopologyWatcher`: follows the control plane's WatchTopology stream, reconnecting when it breaks.

Any control-plane replica serves WatchTopology. The watcher tries the given
addresses in turn, plus the leader address the last snapshot named, and
resumes after the last revision it saw so a reconnect does not replay old
snapshots. Each new snapshot is handed to `on_topology` on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

import grpc

from splitserve import grpc_security
from splitserve.control_plane.service import topology_from_proto
from splitserve.control_plane.topology import Topology
from splitserve.proto.v1 import control_plane_pb2, control_plane_pb2_grpc

log = logging.getLogger(__name__)


class TopologyWatcher:
    """Keeps `latest` current and calls `on_topology(topology)` after every change."""

    def __init__(
        self,
        addresses: Sequence[str],
        on_topology: Callable[[Topology], None],
        *,
        retry_delay_s: float = 0.5,
    ) -> None:
        if not addresses:
            raise ValueError(f"at least one control-plane address is needed, got {addresses!r}")
        self._addresses = list(addresses)
        self._on_topology = on_topology
        self._retry_delay_s = retry_delay_s
        self._task: asyncio.Task[None] | None = None
        self._first = asyncio.Event()
        self.latest: Topology | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._follow(), name="router-topology")

    async def wait_first(self, timeout_s: float) -> Topology:
        """The first snapshot; TimeoutError naming the addresses if none came within `timeout_s`."""
        try:
            await asyncio.wait_for(self._first.wait(), timeout_s)
        except TimeoutError:
            raise TimeoutError(f"no topology from the control plane at {self._addresses} within {timeout_s} s") from None
        return self.latest

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _candidates(self) -> list[str]:
        addresses = list(self._addresses)
        leader = self.latest.leader if self.latest is not None else None
        if leader is not None and leader.address not in addresses:
            addresses.append(leader.address)
        return addresses

    async def _follow(self) -> None:
        is_failing = False
        while True:
            for address in self._candidates():
                try:
                    async with grpc_security.aio_channel(address) as channel:
                        stub = control_plane_pb2_grpc.ControlPlaneStub(channel)
                        revision = self.latest.revision if self.latest is not None else 0
                        request = control_plane_pb2.WatchTopologyRequest(after_revision=revision)
                        async for message in stub.WatchTopology(request):
                            self._apply(topology_from_proto(message))
                            is_failing = False
                except grpc.aio.AioRpcError as e:
                    level = logging.DEBUG if is_failing else logging.WARNING
                    log.log(level, "topology watch on %s ended: %s", address, e.code().name)
                    is_failing = True
                except ValueError as e:  # a snapshot that does not convert (e.g. a newer spec syntax)
                    log.error("bad topology from %s: %s", address, e)
            await asyncio.sleep(self._retry_delay_s)

    def _apply(self, topology: Topology) -> None:
        if self.latest is not None and topology.revision <= self.latest.revision:
            return
        self.latest = topology
        try:
            self._on_topology(topology)
        except Exception:  # a bad snapshot must not stop the watch
            log.exception("applying topology revision %d failed", topology.revision)
        self._first.set()
