"""One control-plane replica: etcd client, leader election, topology feed and the gRPC server.

`splitserve control-plane` (or `python -m splitserve.control_plane`) runs
`serve()` until SIGTERM / SIGINT, then shuts down gracefully: health turns
NOT_SERVING, the replica resigns leadership (a standby takes over at once
instead of after a lease TTL), open WatchTopology streams end, in-flight
calls get `grace_period_s` to finish.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitserve import grpc_security
from splitserve.control_plane.cluster_store import ClusterStore
from splitserve.control_plane.controller import ClusterController
from splitserve.control_plane.election import LeaderElection
from splitserve.control_plane.etcd_client import connect, parse_endpoint
from splitserve.control_plane.keys import ClusterKeys, check_name
from splitserve.control_plane.records import LeaderRecord
from splitserve.control_plane.registry import DEFAULT_LEASE_TTL_S
from splitserve.control_plane.service import ControlPlaneService
from splitserve.control_plane.shard_spec import ShardSpec, parse_inference_shards
from splitserve.control_plane.topology_feed import TopologyFeed
from splitserve.proto.v1 import control_plane_pb2, control_plane_pb2_grpc
from splitserve.telemetry.metrics import ControlPlaneMetrics, MetricsServer, start_metrics_server

log = logging.getLogger(__name__)

SERVICE_NAME = control_plane_pb2.DESCRIPTOR.services_by_name["ControlPlane"].full_name


@dataclass(frozen=True)
class ControlPlaneConfig:
    """Settings of one control-plane replica (flags: see cli.py)."""

    inference_shards: str
    """The --inference-shards spec; every replica of a cluster must be given the same one."""
    etcd: str = "127.0.0.1:2379"
    """etcd endpoint, host:port."""
    listen: str = "127.0.0.1:50051"
    """gRPC listen address, host:port; port 0 picks a free port."""
    advertise_address: str | None = None
    """Address clients are told to reach this replica at; None = the bound listen address."""
    cluster: str = "default"
    """Cluster name: the etcd keys live under <key_prefix>/<cluster>/."""
    key_prefix: str = "/splitserve"
    lease_ttl_s: int = DEFAULT_LEASE_TTL_S
    """TTL of the leader lease: a dead leader is replaced within about this long."""
    replica_id: str | None = None
    """Name of this replica in the leader key; None = <hostname>-<pid>."""
    grace_period_s: float = 5.0
    """How long in-flight calls may run on after shutdown starts."""
    metrics_port: int = 0
    """HTTP port of Prometheus /metrics; 0 = not served."""
    metrics_host: str = "127.0.0.1"
    """Bind address of /metrics."""

    def __post_init__(self) -> None:
        parse_inference_shards(self.inference_shards)  # raises ShardSpecError naming the bad token
        parse_endpoint(self.etcd)
        for name in ("listen", "advertise_address"):
            value = getattr(self, name)
            host, sep, port = (value or "h:0").rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"{name} must be host:port, got {value!r}")
        ClusterKeys(self.cluster, self.key_prefix)
        if not isinstance(self.lease_ttl_s, int) or self.lease_ttl_s < 1:
            raise ValueError(f"lease_ttl_s must be a positive integer, got {self.lease_ttl_s!r}")
        if self.replica_id is not None:
            check_name("replica_id", self.replica_id)
        if self.grace_period_s < 0:
            raise ValueError(f"grace_period_s must be >= 0, got {self.grace_period_s!r}")

    @property
    def spec(self) -> ShardSpec:
        return parse_inference_shards(self.inference_shards)

    @property
    def keys(self) -> ClusterKeys:
        return ClusterKeys(self.cluster, self.key_prefix)


class ControlPlaneServer:
    """A running replica; `start()` then `stop()`, on one event loop."""

    def __init__(self, config: ControlPlaneConfig) -> None:
        self.config = config
        self.replica_id = config.replica_id or f"{socket.gethostname()}-{os.getpid()}"
        self.address: str | None = None
        """The bound address, known after start()."""
        self.election: LeaderElection | None = None
        self._client = connect(config.etcd)
        self._store = ClusterStore(self._client, config.keys, config.spec)
        self._feed = TopologyFeed(self._store)
        self._health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self.metrics = ControlPlaneMetrics(self._metrics_state)
        self.metrics_server: MetricsServer | None = None

    async def start(self) -> str:
        """Checks the spec against etcd, starts serving and campaigning; returns the bound address."""
        reason = self.config.spec.unservable_reason()
        if reason is not None:  # a warning: the spec may be grown later (a new control plane with a new spec)
            log.warning("%s", reason)
        await self._store.ensure_spec()
        await self._feed.start()
        server = grpc_security.aio_server()
        host = self.config.listen.rpartition(":")[0]
        port = grpc_security.add_port(server, self.config.listen)
        self.address = f"{host}:{port}"
        # The leader key advertises the address, so the election needs the bound port.
        record = LeaderRecord(self.replica_id, self.config.advertise_address or self.address)
        self.election = LeaderElection(self._client, self.config.keys, record, self.config.lease_ttl_s)
        controller = ClusterController(self._store, self.election)
        control_plane_pb2_grpc.add_ControlPlaneServicer_to_server(
            ControlPlaneService(controller, self._store, self._feed), server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        await server.start()
        self._server = server
        await self.election.start()
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("control plane %s serving on %s (cluster %s)", self.replica_id, self.address, self.config.cluster)
        self.metrics_server = start_metrics_server(self.metrics.registry, self.config.metrics_port, self.config.metrics_host)
        return self.address

    def _metrics_state(self) -> tuple[bool, int, int, int] | None:
        topology = self._feed.latest
        if topology is None:
            return None
        is_leader = self.election is not None and self.election.is_leader
        filled = sum(1 for o in topology.occupants if o is not None)
        return is_leader, len(topology.occupants), filled, len(topology.workers)

    async def stop(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.stop()
        await self._health.enter_graceful_shutdown()
        if self.election is not None:
            await self.election.close()
        await self._feed.close()
        if self._server is not None:
            await self._server.stop(self.config.grace_period_s)
        await self._client.close()
        if self._server is not None:
            log.info("control plane %s stopped", self.replica_id)


async def serve(config: ControlPlaneConfig, stop: asyncio.Event | None = None) -> None:
    """Runs a replica until `stop` is set, or, without one, until SIGTERM or SIGINT."""
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    server = ControlPlaneServer(config)
    try:
        await server.start()
        await stop.wait()
    finally:
        await server.stop()
