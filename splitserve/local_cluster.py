"""`LocalCluster`: every process of a splitserve cluster on this machine, on loopback, started in order.

    etcd ─▶ control plane ─▶ prefill + decode workers (one per dp replica of --inference-shards)
         ─▶ (every slot filled) ─▶ router ─▶ gateway (GET /health = 200)

`start()` raises StartupError (with the failing process's log tail) after
stopping whatever it had started; `stop()` stops in reverse order: gateway,
router, workers (they drain), control plane, etcd. Nothing here imports torch.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from splitserve import grpc_security
from splitserve.child_process import ChildExitedError, ChildProcess
from splitserve.control_plane.shard_spec import parse_inference_shards
from splitserve.proto.v1 import control_plane_pb2, control_plane_pb2_grpc
from splitserve.readiness import etcd_healthy, free_port, grpc_serving, http_ok, poll, port_is_free

DEFAULT_INFERENCE_SHARDS = "tp=1,role=prefill+tp=1,role=decode"
ETCD_INSTALL_HINT = (
    "install etcd (Debian/Ubuntu: sudo apt-get install etcd-server; macOS: brew install etcd; "
    "others: a release from https://github.com/etcd-io/etcd/releases), or pass --etcd HOST:PORT of a running one"
)


class StartupError(RuntimeError):
    """The cluster did not come up; the message says which process and why."""


EXTERNAL_ETCD_WAIT_S = 15.0
"""How long `--etcd HOST:PORT` (an etcd up does not start) may take to answer /health."""

UP_TRANSPORTS = ("auto", "nixl", "shm", "cuda_ipc", "torch_dist")
"""KV transports between the workers of a one-machine cluster (`--transport` of `splitserve up`)."""


@dataclass(frozen=True)
class UpConfig:
    """What `splitserve up` starts. Paths and ports are resolved when the cluster starts."""

    model: Path | None = None
    """Model directory; None = the embedded default model."""
    served_model_name: str | None = None
    inference_shards: str = DEFAULT_INFERENCE_SHARDS
    engine: str = "torch"
    """"torch" runs the model; "sim" runs simulated workers (no model weights needed)."""
    etcd: str | None = None
    """HOST:PORT of a running etcd; None starts one."""
    etcd_binary: str | None = None
    """The etcd executable; None = `etcd` on PATH."""
    host: str = "127.0.0.1"
    """Gateway bind address."""
    port: int = 8000
    """Gateway port; 0 = a free one."""
    router_port: int = 0
    control_plane_port: int = 0
    api_keys: tuple[str, ...] = ()
    transport: str = "auto"
    """KV transport (`UP_TRANSPORTS`): auto (NIXL when installed, else torch_dist), nixl, shm (CPU
    pools), cuda_ipc (GPU pools), torch_dist. Not inproc: it reaches only its own process, and
    every worker here is a process of its own."""
    block_size: int = 16
    device: str = "auto"
    worker_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    cluster: str = "default"
    work_dir: Path | None = None
    """Logs and etcd data; None = a fresh temporary directory."""
    startup_timeout_s: float = 180.0
    worker_grace_s: float = 5.0
    max_restarts: int = 5
    """A child that exits is restarted (same command, same ports) at most this often per minute;
    0 = any exit stops the cluster (splitserve/supervisor.py)."""
    child_env: tuple[tuple[str, str], ...] = ()
    """SPLITSERVE_* variables every child gets: the security options (TLS, etcd credentials), kept off `ps`."""

    def __post_init__(self) -> None:
        reason = parse_inference_shards(self.inference_shards).unservable_reason()  # ShardSpecError names a bad token
        if reason is not None:
            raise ValueError(reason)
        if self.engine not in ("torch", "sim"):
            raise ValueError(f"engine must be 'torch' or 'sim', got {self.engine!r}")
        if self.transport not in UP_TRANSPORTS:
            hint = " (in-process: each worker here is a process of its own)" if self.transport == "inproc" else ""
            raise ValueError(f"transport must be one of {', '.join(UP_TRANSPORTS)}, got {self.transport!r}{hint}")
        if self.transport in ("cuda_ipc", "shm") and self.engine == "torch":
            self._check_transport_device()
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        for name in ("port", "router_port", "control_plane_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be in [0, 65536), got {getattr(self, name)!r}")
        if self.model is not None and not Path(self.model).is_dir():
            raise ValueError(f"--model {str(self.model)!r} is not a directory")

    def _check_transport_device(self) -> None:
        """cuda_ipc maps GPU pools, shm CPU ones: refused up front for workers on the other kind of
        device, rather than a worker exiting with a transport's message. `--device auto` is resolved
        as the workers will (`engine.devices.resolve_device`); only here does `up` import torch."""
        device = self.device
        if device == "auto":
            from splitserve.engine.devices import resolve_device

            device = resolve_device("auto").type
        where = "" if self.device != "auto" else f" (--device auto is {device} here)"
        if self.transport == "cuda_ipc" and not device.startswith("cuda"):
            raise ValueError(f"transport cuda_ipc maps GPU memory: it needs workers on CUDA{where}; "
                             f"CPU workers hand off over nixl (default) or shm")
        if self.transport == "shm" and device.startswith("cuda"):
            raise ValueError(f"transport shm maps CPU pools: GPU workers{where} hand off over nixl (default) or "
                             f"cuda_ipc")


@dataclass
class Endpoints:
    """Where the started cluster listens (known as start() proceeds)."""

    etcd: str | None = None
    control_plane: str | None = None
    workers: list[str] = field(default_factory=list)
    router: str | None = None
    gateway_url: str | None = None


class LocalCluster:
    def __init__(self, config: UpConfig, work_dir: Path, *, progress: Callable[[str], None] = print,
                 echo_children: bool = False, drop_env: frozenset[str] = frozenset()) -> None:  # fmt: skip
        """`drop_env`: environment variables the children must not inherit (those meant for `up` itself)."""
        self.config = config
        self.work_dir = work_dir
        self.endpoints = Endpoints()
        self._progress = progress
        self._echo_children = echo_children
        self._drop_env = drop_env
        self._children: list[ChildProcess] = []
        self._started_at = time.monotonic()

    @property
    def children(self) -> tuple[ChildProcess, ...]:
        return tuple(self._children)

    # ------------------------------------------------------------------ start
    async def start(self) -> None:
        """Starts everything; StartupError (after stopping what started) if any part fails or times out."""
        self._started_at = time.monotonic()
        c = self.config
        if c.port and not port_is_free(c.host, c.port):  # before minutes of start-up are spent
            raise StartupError(f"port {c.port} on {c.host} is in use; pass --port 0 for a free one, or another port")
        try:
            async with asyncio.timeout(self.config.startup_timeout_s):
                await self._start_etcd()
                await self._start_control_plane()
                await self._start_workers()
                await self._start_router()
                await self._start_gateway()
        except TimeoutError:
            await self.stop()
            raise StartupError(f"the cluster did not start within {self.config.startup_timeout_s:.0f} s; "
                               f"logs are in {self.log_dir}") from None  # fmt: skip
        except ChildExitedError as e:
            await self.stop()
            raise StartupError(str(e)) from None
        except BaseException:
            await self.stop()
            raise

    @property
    def log_dir(self) -> Path:
        return self.work_dir / "logs"

    async def _start_etcd(self) -> None:
        if self.config.etcd:
            self.endpoints.etcd = self.config.etcd
            try:  # a running etcd answers at once: no need to wait out the whole start-up timeout
                async with asyncio.timeout(EXTERNAL_ETCD_WAIT_S):
                    await poll(lambda: etcd_healthy(self.config.etcd), None, f"etcd at {self.config.etcd} is not healthy")
            except TimeoutError:
                raise StartupError(f"etcd at {self.config.etcd} did not answer its /health check within "
                                   f"{EXTERNAL_ETCD_WAIT_S:.0f} s: is it running and listening on that address? "
                                   "(without --etcd, splitserve up starts its own)") from None
            self._done("etcd", self.config.etcd, "(external)")
            return
        binary = self.config.etcd_binary or shutil.which("etcd")
        if binary is None or not os.access(binary, os.X_OK):
            raise StartupError(f"etcd not found{'' if self.config.etcd_binary else ' on PATH'}: {ETCD_INSTALL_HINT}")
        client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
        argv = [
            binary, "--name=splitserve-up", f"--data-dir={self.work_dir / 'etcd'}", f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}", f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=splitserve-up={peer}", "--heartbeat-interval=50", "--election-timeout=250",
            "--log-level=warn",
        ]  # fmt: skip
        child = await self._spawn("etcd", argv)
        self.endpoints.etcd = client.removeprefix("http://")
        await poll(lambda: etcd_healthy(self.endpoints.etcd), child, "etcd did not become healthy")
        self._done("etcd", self.endpoints.etcd)

    async def _start_control_plane(self) -> None:
        address = f"127.0.0.1:{self.config.control_plane_port or free_port()}"
        child = await self._spawn("control-plane", self._splitserve(
            "control-plane", "--etcd", self.endpoints.etcd, "--inference-shards", self.config.inference_shards,
            "--listen", address, "--cluster", self.config.cluster,
        ))  # fmt: skip
        self.endpoints.control_plane = address
        await poll(lambda: self._topology() is not None, child, "the control plane did not answer")
        self._done("control plane", address)

    async def _start_workers(self) -> None:
        spec = parse_inference_shards(self.config.inference_shards)
        starting = []
        for group in spec.groups:
            for replica in range(group.dp):
                role = group.role.value
                name = f"{role}-worker-g{group.index}-dp{replica}"
                argv = self._splitserve(f"{role}-worker", "--etcd", self.endpoints.etcd, "--cluster", self.config.cluster,
                                        "--tp", str(group.tp), "--pp", str(group.pp), *self._worker_flags())  # fmt: skip
                display = f"{role} worker (group {group.index}, dp {replica})"
                starting.append((display, await self._spawn(name, argv)))
        self._progress(f"  starting {len(starting)} worker process(es) on {self.config.engine} engines ...")
        for display, child in starting:
            line = await child.wait_for_line("READY ", self.config.startup_timeout_s)
            address = line.split()[1]
            self.endpoints.workers.append(address)
            self._done(display, address)
        await poll(self._is_topology_complete, None, "the workers did not fill every slot of --inference-shards")

    def _worker_flags(self) -> list[str]:
        c = self.config
        flags = ["--block-size", str(c.block_size), "--grace-s", str(c.worker_grace_s)]
        if c.model is not None:
            flags += ["--model", str(c.model)]
        if c.engine == "sim":
            flags += ["--engine", "sim"]
        else:
            flags += ["--device", c.device, "--transport", resolve_transport(c.transport)]
        return flags + list(c.worker_args)

    async def _start_router(self) -> None:
        address = f"127.0.0.1:{self.config.router_port or free_port()}"
        child = await self._spawn("router", self._splitserve(
            "router", "--control-plane", self.endpoints.control_plane, "--listen", address,
            "--block-size", str(self.config.block_size), *self.config.router_args,
        ))  # fmt: skip
        self.endpoints.router = address
        await poll(lambda: grpc_serving(address), child, "the router did not start serving")
        self._done("router", address)

    async def _start_gateway(self) -> None:
        c = self.config
        port = c.port or free_port()
        argv = ["gateway", "--router", self.endpoints.router, "--host", c.host, "--port", str(port)]
        if c.model is not None:
            argv += ["--model", str(c.model)]
        if c.served_model_name:
            argv += ["--served-model-name", c.served_model_name]
        env = {"SPLITSERVE_API_KEY": ",".join(c.api_keys)} if c.api_keys else {}  # keys stay out of `ps`
        child = await self._spawn("gateway", self._splitserve(*argv, *c.gateway_args), env)
        shown_host = "127.0.0.1" if c.host in ("0.0.0.0", "::", "") else c.host
        url = f"http://{shown_host}:{port}"
        await poll(lambda: http_ok(f"{url}/health"), child, "the gateway did not become healthy")
        self.endpoints.gateway_url = url
        self._done("gateway", url)

    # ------------------------------------------------------------------ stop
    async def stop(self) -> list[str]:
        """Stops every child, newest first; the names of any that left processes behind (should be none)."""
        graces = {"gateway": 8.0, "router": 8.0, "control-plane": 10.0, "etcd": 10.0}
        workers = [c for c in self._children if "worker" in c.name]
        others = [c for c in self._children if "worker" not in c.name]
        order = [c for c in reversed(others) if c.name in ("gateway", "router")]
        for child in order:
            await child.stop(graces[child.name])
        await asyncio.gather(*(c.stop(self.config.worker_grace_s + 10.0) for c in workers))
        for child in reversed(others):
            if child not in order:
                await child.stop(graces.get(child.name, 10.0))
        return [c.name for c in self._children if c.is_group_alive()]

    async def wait_for_exit(self) -> ChildProcess:
        """The first child that exits (while the cluster should be running)."""
        waits = {asyncio.create_task(c.wait()): c for c in self._children}
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
        return waits[next(iter(done))]

    # --------------------------------------------------------------- helpers
    def _splitserve(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "splitserve", *args]

    async def _spawn(self, name: str, argv: list[str], extra_env: dict[str, str] | None = None) -> ChildProcess:
        env = {k: v for k, v in os.environ.items() if k not in self._drop_env}
        env.update(PYTHONUNBUFFERED="1", **dict(self.config.child_env), **(extra_env or {}))
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("UCX_NET_DEVICES", "lo")
        echo = (lambda line, n=name: self._progress(f"[{n}] {line}")) if self._echo_children else None
        child = ChildProcess(name, argv, self.log_dir / f"{name}.log", env=env, echo=echo)
        await child.start()
        self._children.append(child)
        return child

    def _done(self, what: str, where: str, note: str = "") -> None:
        took = time.monotonic() - self._started_at
        self._progress(f"  {what:<34} {where:<28} ready at {took:5.1f} s {note}".rstrip())

    def _topology(self):
        try:
            with grpc_security.sync_channel(self.endpoints.control_plane) as channel:
                stub = control_plane_pb2_grpc.ControlPlaneStub(channel)
                return stub.GetTopology(control_plane_pb2.GetTopologyRequest(), timeout=2)
        except grpc.RpcError:
            return None

    def _is_topology_complete(self) -> bool:
        topology = self._topology()
        return topology is not None and bool(topology.slots) and all(s.worker_id for s in topology.slots)


def resolve_transport(transport: str) -> str:
    """`auto`: NIXL when its package is installed, else torch.distributed (gloo on CPU, NCCL on GPU)."""
    if transport != "auto":
        return transport
    has_nixl = importlib.util.find_spec("nixl_cu13") is not None or importlib.util.find_spec("nixl") is not None
    return "nixl" if has_nixl else "torch_dist"
