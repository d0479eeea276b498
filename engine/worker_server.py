"""The part of a worker's gRPC process that does not depend on its role:
start the rank group, bind the server (127.0.0.1 by default), health service,
optional control-plane registration, and a graceful stop on SIGTERM / SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitserve.engine.worker_runtime import HooksFactory, WorkerGroup, WorkerSpec

log = logging.getLogger(__name__)


async def serve_worker(
    spec: WorkerSpec,
    listen: str,
    hooks_factory: HooksFactory,
    add_servicer: Callable[[grpc.aio.Server, WorkerGroup], str],
    *,
    etcd: str | None = None,
    cluster: str = "default",
    grace_s: float = 10.0,
    stop: asyncio.Event | None = None,
) -> None:
    """Run until SIGTERM/SIGINT (or `stop` is set). Prints `READY <address>` once serving."""
    group = await asyncio.to_thread(WorkerGroup, spec, hooks_factory)
    server = grpc.aio.server()
    service_name = add_servicer(server, group)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(listen)
    if port == 0:
        group.close()
        raise OSError(f"cannot listen on {listen!r}")
    host = listen.rsplit(":", 1)[0]
    address = f"{host}:{port}"
    await server.start()
    for name in ("", service_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    registration = None
    if etcd:
        from splitserve.control_plane.keys import ClusterKeys
        from splitserve.control_plane.shard_spec import Role
        from splitserve.control_plane.worker_registration import WorkerRegistration

        registration = WorkerRegistration(
            etcd=etcd,
            address=address,
            role=Role(spec.role),
            num_gpu_ranks=spec.world_size,
            keys=ClusterKeys(cluster=cluster),
        )
        await registration.start()
    print(f"READY {address}", flush=True)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping: draining for up to %.0f s", grace_s)
    await health_servicer.enter_graceful_shutdown()
    if registration is not None:
        with contextlib.suppress(Exception):
            await registration.close()
    await server.stop(grace_s)
    await asyncio.to_thread(group.close)


def run_worker_main(coro_factory: Callable[[], object]) -> int:
    """Run a worker's `serve` coroutine; clean exit codes, no tracebacks for bad input."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(coro_factory())
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
