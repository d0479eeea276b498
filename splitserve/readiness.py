"""Readiness probes of `splitserve up`: free ports, etcd / HTTP / gRPC health, polling with a watch on the child."""

from __future__ import annotations

import asyncio
import socket
import ssl
import urllib.request
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve import grpc_security
from splitserve.child_process import ChildExitedError, ChildProcess
from splitserve.control_plane import etcd_client


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


async def poll(check: Callable[[], bool], child: ChildProcess | None, what: str, interval_s: float = 0.1) -> None:
    """Runs the blocking `check` in a thread until it is true; ChildExitedError if `child` dies meanwhile."""
    while True:
        if await asyncio.to_thread(check):
            return
        if child is not None and child.returncode is not None:
            await child.wait()
            raise ChildExitedError(f"{what}: {child.exit_message()}")
        await asyncio.sleep(interval_s)


def etcd_healthy(endpoint: str) -> bool:
    options = etcd_client.current()  # --etcd-ca: etcd serves https
    if not options.is_tls:
        return http_ok(f"http://{endpoint}/health")
    context = ssl.create_default_context(cafile=str(options.ca))
    if options.cert is not None:
        context.load_cert_chain(str(options.cert), str(options.key))
    try:
        with urllib.request.urlopen(f"https://{endpoint}/health", timeout=2, context=context) as response:
            return response.status == 200
    except (OSError, ValueError):
        return False


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""Loopback checks must not go through an HTTP proxy from the environment."""


def http_ok(url: str) -> bool:
    try:
        with _NO_PROXY.open(url, timeout=2) as response:
            return response.status == 200
    except (OSError, ValueError):
        return False


def grpc_serving(address: str) -> bool:
    try:
        with grpc_security.sync_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
