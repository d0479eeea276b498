"""The part of a worker's gRPC process that does not depend on its role:
start the rank group, bind the server (127.0.0.1 by default), health service,
optional control-plane registration, and a graceful stop on SIGTERM / SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import signal
import sys
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitserve import grpc_security
from splitserve.engine.serving import EngineStoppedError
from splitserve.engine.worker_runtime import HooksFactory, WorkerGroup, WorkerSpec
from splitserve.telemetry import init_process
from splitserve.telemetry.metrics import start_metrics_server

log = logging.getLogger(__name__)


def unavailable_when_stopped(method):
    """For a worker servicer's unary method: an `EngineStoppedError` becomes gRPC UNAVAILABLE
    (the caller tries another worker) rather than UNKNOWN and a traceback in the log."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except EngineStoppedError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{exc}: this worker is going away")

    return wrapper


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
    metrics_port: int = 0,
    metrics_host: str = "127.0.0.1",
) -> None:
    """Run until SIGTERM/SIGINT (or `stop` is set). Prints `READY <address>` once serving.
    `metrics_port` (0 = off) serves the worker's Prometheus /metrics over HTTP."""
    # Bind first (port 0: the kernel picks a free one, no race with other processes), so
    # the address registered with the control plane is one this process already holds.
    # No SO_REUSEPORT: a second worker on the same port must fail loudly, not share it.
    server = grpc_security.aio_server(options=[("grpc.so_reuseport", 0)])
    host = listen.rpartition(":")[0]
    try:
        port = grpc_security.add_port(server, listen)  # TLS when configured
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(f"cannot listen on {listen!r}")
    address = f"{host}:{port}"
    registration = publisher = None
    if etcd:
        from splitserve.control_plane.worker_registration import default_worker_id
        from splitserve.engine.kv_events import KVEventPublisher

        worker_id = default_worker_id()
        publisher = KVEventPublisher(worker_id, spec.engine_options.get("block_size_tokens", 16), f"tcp://{host}:0")
        try:
            registration, spec = await _register(spec, etcd, cluster, address, worker_id, publisher)
        except BaseException:
            publisher.close()
            raise
    spec = _resolve_pack_for_tp(spec, registration)
    try:
        group = await asyncio.to_thread(WorkerGroup, spec, hooks_factory, publisher)
    except BaseException:
        if registration is not None:
            await registration.close()
        if publisher is not None:
            publisher.close()
        raise
    if spec.warm_up and spec.engine != "sim":
        try:
            report = await asyncio.to_thread(group.warm_up)
        except BaseException:
            await asyncio.to_thread(group.close)
            if registration is not None:
                await registration.close()
            if publisher is not None:
                publisher.close()
            raise
        log.info("warmed up in %.2f s: %d dummy requests at batch sizes %s", report.seconds, report.num_requests,
                 ", ".join(map(str, report.batches)))  # fmt: skip
    service_name = add_servicer(server, group)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        metrics_server = start_metrics_server(group.metrics.registry, metrics_port, metrics_host)
    except OSError:
        group.close()
        raise
    await server.start()
    for name in ("", service_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    follower = None
    if registration is not None:
        follower = asyncio.get_running_loop().create_task(follow_lifecycle(registration, group))
    print(f"READY {address}", flush=True)
    if metrics_server is not None:  # after READY: launchers read that line first
        log.info("metrics on http://%s/metrics", metrics_server.address)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    crashed = asyncio.Event()
    group.on_crash = lambda: loop.call_soon_threadsafe(crashed.set)
    if group.has_crashed:
        crashed.set()
    await _first_set(stop, crashed)
    if follower is not None:
        follower.cancel()
    if crashed.is_set():
        # Nothing in flight can finish, so no drain: leave the topology, end the calls (the
        # router retries them elsewhere) and exit non-zero so a supervisor restarts the worker.
        group.draining = True
        await health_servicer.enter_graceful_shutdown()
        if registration is not None:
            with contextlib.suppress(Exception):
                await registration.close()
    else:
        await drain(group, health_servicer, registration, grace_s)
    await server.stop(0 if crashed.is_set() else 1.0)
    if metrics_server is not None:
        metrics_server.stop()
    await asyncio.to_thread(group.close)
    if publisher is not None:
        publisher.close()
    if crashed.is_set():
        raise EngineCrashedError("the engine loop crashed (its traceback is logged above); exiting so that it is restarted")


class EngineCrashedError(RuntimeError):
    """The worker's engine loop died; the process exits with code 1."""


async def _first_set(*events: asyncio.Event) -> None:
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


async def drain(group: WorkerGroup, health_servicer, registration, grace_s: float) -> bool:
    """Graceful drain: deregister, refuse new work (health NOT_SERVING), finish
    in-flight requests, and wait until no handoff pins remain (decode peers
    ack, or leases expire). Release/Abort keep working meanwhile. Returns True
    if everything finished within `grace_s` (+ the handoff lease)."""
    group.draining = True
    await health_servicer.enter_graceful_shutdown()
    if registration is not None:
        with contextlib.suppress(Exception):
            await registration.close()
    engine = group.engine
    deadline = time.monotonic() + grace_s + engine.config.cache.handoff_lease_s
    while time.monotonic() < deadline:
        if group.num_in_flight == 0 and not engine.has_unfinished() and engine.num_pinned_blocks == 0:
            log.info("drained")
            return True
        await asyncio.sleep(0.05)
    log.warning("drain timed out: %d in flight, %d pinned blocks", group.num_in_flight, engine.num_pinned_blocks)
    return False


async def follow_lifecycle(registration, group: WorkerGroup, poll_s: float = 0.1) -> None:
    """Bring the group to the cluster lifecycle the control plane publishes:
    pause / unpause, suspend / resume, and a weight reload whenever the
    cluster's weights_version is ahead of ours (only ever while suspended)."""
    from splitserve.control_plane.lifecycle import LifecycleState
    from splitserve.engine.serving import Command

    paused = suspended = False
    version = registration.topology.lifecycle.weights_version if registration.topology else 0

    async def do(kind: str, *args) -> None:
        await asyncio.wrap_future(group.loop.submit(Command(kind, args=args)))
        log.info("lifecycle: %s %s", kind, " ".join(map(str, args)))

    while True:
        topology = registration.topology
        if topology is not None:
            target = topology.lifecycle
            try:
                # A reload we missed (the cluster already resumed) still goes through
                # pause -> suspend -> reload locally: weights never change under a step.
                reload = target.weights_version > version and bool(target.checkpoint_path)
                if (target.state is not LifecycleState.RUNNING or reload) and not paused:
                    await do("pause")
                    paused = True
                if (target.state is LifecycleState.SUSPENDED or reload) and not suspended:
                    await do("suspend")
                    suspended = True
                if reload:
                    version = target.weights_version  # also on failure: no retry storm
                    await do("reload_weights", target.checkpoint_path)
                if target.state is not LifecycleState.SUSPENDED and suspended:
                    await do("resume")
                    suspended = False
                if target.state is LifecycleState.RUNNING and paused:
                    await do("unpause")
                    paused = False
            except Exception:  # keep following; the next change may succeed
                log.exception("lifecycle step failed")
        await asyncio.sleep(poll_s)


def _resolve_pack_for_tp(spec: WorkerSpec, registration) -> WorkerSpec:
    """`--pack-for-tp auto` → an int, from the decode groups of the cluster's shard spec."""
    from splitserve.control_plane.shard_spec import Role
    from splitserve.engine.handoff_pack import PACK_AUTO, resolve_pack_for_tp

    value = spec.engine_options.get("pack_for_tp", 0)
    if value != PACK_AUTO:
        return spec
    topology = registration.topology if registration is not None else None
    decode_tps = None if topology is None else [g.tp for g in topology.spec.groups if g.role is Role.DECODE]
    transport = "sim" if spec.engine == "sim" else spec.transport  # the sim engine has no KV to pack
    resolved = resolve_pack_for_tp(value, role=spec.role, transport=transport, world_size=spec.world_size,
                                   decode_tps=decode_tps)
    if resolved:
        log.info("packing handoffs for decode TP sizes the router names (default tp=%d): --pack-for-tp auto", resolved)
    return dataclasses.replace(spec, engine_options={**spec.engine_options, "pack_for_tp": resolved},
                               pack_for_tp_auto=True)


async def _register(spec: WorkerSpec, etcd: str, cluster: str, address: str, worker_id: str, publisher):
    """Take a slot from the control plane; the slot's group decides tp and pp.

    The worker hosts a whole dp replica (all tp x pp ranks, one process each):
    it asks for `spec.world_size` ranks and must get a complete replica. It
    advertises its KV-event endpoint and block size for routers.
    """
    import aetcd

    from splitserve.control_plane.etcd_client import EtcdUnavailableError
    from splitserve.control_plane.keys import ClusterKeys
    from splitserve.control_plane.shard_spec import Role
    from splitserve.control_plane.worker_registration import WorkerRegistration

    registration = WorkerRegistration(
        etcd=etcd,
        address=address,
        role=Role(spec.role),
        num_gpu_ranks=spec.world_size,
        worker_id=worker_id,
        keys=ClusterKeys(cluster=cluster),
        kv_events_endpoint=publisher.endpoint,
        kv_block_size=publisher.block_size,
    )
    try:
        assignment = await registration.start()
    except aetcd.ClientError as exc:  # no etcd there (or it refused us): one line, not aetcd's traceback
        raise EtcdUnavailableError(f"etcd at {etcd}: {exc}") from exc
    try:
        if spec.engine_options.get("pack_for_tp") == "auto":  # it reads the shard spec from the topology
            with contextlib.suppress(TimeoutError):
                await registration.wait_for(lambda r: r.topology is not None, timeout_s=5.0)
        slot = assignment.slots[0]
        if len(assignment.slots) != slot.tp * slot.pp:
            raise ValueError(
                f"slot group needs tp={slot.tp} x pp={slot.pp} ranks but this worker hosts {len(assignment.slots)}; "
                f"start it with --tp {slot.tp} --pp {slot.pp}"
            )
        log.info("assigned group %d replica %d (tp=%d, pp=%d)", slot.group_index, slot.dp_replica, slot.tp, slot.pp)
        spec = dataclasses.replace(spec, tensor_parallel_size=slot.tp, pipeline_parallel_size=slot.pp)
    except BaseException:
        await registration.close()
        raise
    return registration, spec


def run_worker_main(coro_factory: Callable[[], object], service: str = "splitserve-worker") -> int:
    """Run a worker's `serve` coroutine; clean exit codes, no tracebacks for bad input.
    Tracing (OTEL_* variables) and logs are set up for a process named `service`."""
    init_process(service, logging.INFO)
    try:
        asyncio.run(coro_factory())
    except ConnectionError as exc:  # etcd unreachable (EtcdUnavailableError) and the like: may pass on a retry
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except EngineCrashedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
