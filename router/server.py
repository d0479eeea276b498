"""`RouterServer`: one router process — topology watch, KV-event subscriber, orchestrator, gRPC server.

    server = RouterServer(RouterConfig(control_planes=("127.0.0.1:50051",)))
    address = await server.start()   # waits for the first topology; BlockSizeMismatchError if a worker disagrees
    ...
    await server.stop()

`splitserve router` runs `serve()` until SIGTERM / SIGINT. Routers keep no
shared state, so several can run side by side behind one address.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Mapping

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitserve import grpc_security
from splitserve.control_plane.topology import Topology
from splitserve.proto.v1 import router_pb2, router_pb2_grpc
from splitserve.router.cluster_view import ClusterView, check_block_sizes
from splitserve.router.config import RouterConfig
from splitserve.router.kv_events import KVEventSubscriber
from splitserve.router.orchestrator import Orchestrator
from splitserve.router.service import RouterService
from splitserve.router.topology_watcher import TopologyWatcher
from splitserve.router.worker_client import GrpcWorkerClient
from splitserve.router.workers import WorkerEndpoint, routable_workers
from splitserve.telemetry.metrics import MetricsServer, RouterMetrics, start_metrics_server

log = logging.getLogger(__name__)

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


class RouterServer:
    """A running router; `start()` then `stop()`, on one event loop."""

    def __init__(self, config: RouterConfig, *, static_workers: Mapping[str, WorkerEndpoint] | None = None) -> None:
        """`static_workers` replaces the control plane with a fixed worker set (tests, one-node setups)."""
        if not config.control_planes and static_workers is None:
            raise ValueError("a router needs control-plane addresses or static_workers, got neither")
        self.config = config
        self.address: str | None = None
        """The bound address, known after start()."""
        self.view: ClusterView | None = None
        self.subscriber: KVEventSubscriber | None = None
        self.orchestrator: Orchestrator | None = None
        self.client = GrpcWorkerClient()
        self.metrics = RouterMetrics()
        self.metrics_server: MetricsServer | None = None
        """Serving /metrics once started, when config.metrics_port is set."""
        self._static_workers = static_workers
        self._watcher: TopologyWatcher | None = None
        self._health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> str:
        """Reads the workers, checks their block size, starts serving; returns the bound address."""
        if self._static_workers is not None:
            workers = dict(self._static_workers)
        else:
            self._watcher = TopologyWatcher(self.config.control_planes, self._on_topology)
            self._watcher.start()
            workers = routable_workers(await self._watcher.wait_first(self.config.topology_timeout_s))
        block_size = check_block_sizes(workers, self.config.block_size)  # raises BlockSizeMismatchError
        self.view = ClusterView(
            block_size, max_running_per_worker=self.config.max_running_per_worker,
            approximate_ttl_s=self.config.approximate_ttl_s, suspect_cooldown_s=self.config.suspect_cooldown_s,
        )  # fmt: skip
        if self.config.kv_events:
            self.subscriber = KVEventSubscriber(self.view.index, self._fetch_block_set, block_size)
            self.subscriber.start()
            self.view.uses_events = True
            self.view.on_workers_changed(self.subscriber.set_workers)
        self.orchestrator = Orchestrator(self.config, self.view, self.client, self.metrics)
        self.metrics_server = start_metrics_server(self.metrics.registry, self.config.metrics_port, self.config.metrics_host)
        self.set_workers(workers if self._watcher is None else routable_workers(self._watcher.latest))
        server = grpc_security.aio_server()
        router_pb2_grpc.add_RouterServicer_to_server(RouterService(self.orchestrator), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        host = self.config.listen.rpartition(":")[0]
        port = grpc_security.add_port(server, self.config.listen)
        self.address = f"{host}:{port}"
        await server.start()
        self._server = server
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("router serving on %s: %d workers, block size %d", self.address, len(self.view.workers), block_size)
        if self.metrics_server is not None:
            log.info("router metrics on http://%s/metrics", self.metrics_server.address)
        return self.address

    def set_workers(self, workers: Mapping[str, WorkerEndpoint]) -> None:
        """Replaces the routable workers (every topology change; tests call it directly)."""
        if self.view is None:
            return  # before start() has checked the block size: start() applies the latest topology
        self.view.set_workers(workers)
        task = asyncio.create_task(self.client.set_workers(self.view.workers))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(self.config.grace_period_s)
        if self.orchestrator is not None:
            await self.orchestrator.close()
        if self._watcher is not None:
            await self._watcher.close()
        if self.subscriber is not None:
            await self.subscriber.close()
        await self.client.close()
        if self.metrics_server is not None:
            self.metrics_server.stop()

    def _on_topology(self, topology: Topology) -> None:
        self.set_workers(routable_workers(topology))

    async def _fetch_block_set(self, worker: WorkerEndpoint):
        return await self.client.get_block_set(worker, self.config.control_timeout_s)


async def serve(config: RouterConfig, stop: asyncio.Event | None = None) -> None:
    """Runs a router until `stop` is set, or, without one, until SIGTERM or SIGINT."""
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    server = RouterServer(config)
    try:
        await server.start()
        await stop.wait()
    finally:
        await server.stop()
