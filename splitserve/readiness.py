"""Readiness probes of `splitserve up`: free ports, etcd / HTTP / gRPC health, polling with a watch on the child."""

from __future__ import annotations

import asyncio
import random
import socket
import ssl
import urllib.request
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve import grpc_security
from splitserve.child_process import ChildExitedError, ChildProcess
from splitserve.control_plane import etcd_client

_PORT_SPAN = 12000
"""How many ports below the kernel's ephemeral range `free_port` draws from."""


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_port(host: str = "127.0.0.1", tries: int = 64) -> int:
    """A TCP port on `host` that was free a moment ago, for a server started next.

    Drawn at random from just below the kernel's ephemeral range (Linux: 32768-60999, so
    20768-32767), not from the kernel's own `bind(0)` pick: that pick comes from the ephemeral
    range, where every outgoing connection's source port and every other server started on port
    0 also land — a port handed out that way can be taken before our server binds it (seen with
    64 simulated workers: gRPC's SO_REUSEPORT then let two servers share it). Outside the range
    only another explicit picker can collide, at random among ~12k ports. Falls back to
    `bind(0)` where the range is unknown or nothing below it is free."""
    low = _ephemeral_low()
    if low is not None and low - _PORT_SPAN >= 1024:
        rng = random.SystemRandom()
        for _ in range(tries):
            port = rng.randrange(low - _PORT_SPAN, low)
            if port_is_free(host, port):
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    """Could a server bind `host:port` now? Asked as our servers bind (uvicorn, gRPC, etcd and
    http.server all set SO_REUSEADDR), so the TIME_WAIT connections a stopped server leaves for
    a minute do not count as the port being in use; a listening socket does."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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
