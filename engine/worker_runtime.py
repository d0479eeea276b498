"""What prefill and decode workers share: one process per rank of the worker's
TP × PP group, an engine and a KV transport on each, and an `EngineLoop`.

    worker process (rank 0) ── spawns ──▶ rank 1 … rank N-1   (file:// rendezvous, gloo / NCCL)
       │ gRPC server (asyncio, main thread)
       │ EngineLoop thread ◀── broadcast commands ──▶ EngineLoop on every other rank
       └ endpoints: every rank exposes its KV pool to the transport; rank 0 gathers the metadata

Role-specific behaviour comes from a `hooks_factory(engine, transport, endpoints)`
— a module-level function, so spawned ranks can build the same hooks.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from splitserve.engine.engine import Engine
from splitserve.engine.handoff import RankEndpoint
from splitserve.engine.llm import build_engine_config
from splitserve.engine.serving import Command, EngineLoop
from splitserve.engine.sim_engine import SimConfig
from splitserve.engine.state_handoff import expose_state
from splitserve.engine.transfer.transport import TransportEndpoint
from splitserve.engine.warmup import warm_up
from splitserve.engine.worker_integrity import check_integrity
from splitserve.telemetry.metrics import WorkerMetrics

log = logging.getLogger(__name__)

TRANSPORTS = ("nixl", "inproc", "cuda_ipc", "torch_dist", "shm")
ENGINES = ("torch", "sim")


@dataclass(frozen=True)
class WorkerSpec:
    """How to build one worker group's engines."""

    model: str | None
    role: str
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    transport: str = "nixl"
    """KV transport: nixl (UCX; DRAM on CPU, VRAM on GPU), torch_dist (the prefill worker
    pushes over a gloo / NCCL group of the pair, same host only; engine/handoff_push.py) or
    inproc (same process only). Ignored by engine="sim", which has no KV memory (it uses the
    no-op sim transport)."""
    address: str = "127.0.0.1"
    """Host the transport advertises for this worker."""
    engine_options: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    engine: str = "torch"
    """torch: run the model. sim: run none — modelled timing, a real block pool and
    prefix cache, pseudo-tokens (engine/sim_engine.py); one rank only."""
    sim: SimConfig = field(default_factory=SimConfig)
    """Timing and vocabulary of engine="sim" (unused otherwise)."""
    warm_up: bool = True
    """Run dummy requests through the engines before the worker serves (engine/warmup.py): kernel
    compiles, CUDA graph captures and first-use costs leave the first clients' latency."""
    pack_for_tp_auto: bool = False
    """engine_options["pack_for_tp"] was resolved from `--pack-for-tp auto` (worker_server.py): a
    TP size the model's kv heads do not fit is then warned about and not packed for, where an
    explicit `--pack-for-tp N` that does not fit is refused at start."""

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "aggregated"):
            raise ValueError(f"role must be prefill, decode or aggregated, got {self.role!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.engine == "sim" and self.world_size != 1:
            raise ValueError(
                f"engine 'sim' runs one rank; got tp={self.tensor_parallel_size} x pp={self.pipeline_parallel_size}"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def make_transport(kind: str, role: str = "prefill", pack_arena_bytes: int = 0) -> TransportEndpoint:
    """The rank's transport; `role` "decode" only pulls (a NIXL agent without a progress thread).
    `pack_arena_bytes`: a NIXL prefill rank's memory for source-packed reshards (handoff_pack.py)."""
    if kind == "sim":
        from splitserve.engine.sim_engine import SimTransport

        return SimTransport()
    if kind == "nixl":
        from splitserve.engine.transfer.nixl_transport import NixlTransport

        return NixlTransport(progress_thread=role != "decode", pack_arena_bytes=pack_arena_bytes)
    if kind == "shm":
        from splitserve.engine.transfer.shm_transport import ShmTransport

        return ShmTransport()
    if kind == "cuda_ipc":
        from splitserve.engine.transfer.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport()
    if kind == "torch_dist":
        from splitserve.engine.handoff_push import TorchDistTransport

        return TorchDistTransport()
    from splitserve.engine.transfer.inproc import InProcTransport

    return InProcTransport()


def _pack_arena_bytes(spec: WorkerSpec, engine: Engine) -> int:
    """Packed memory for `--pack-for-tp` (prefill role); refuses setups it cannot serve."""
    config = getattr(engine, "config", None)
    if config is None or not config.transfer.pack_for_tp or spec.role != "prefill":
        return 0
    from splitserve.engine.handoff_pack import arena_bytes, pack_target

    if spec.transport != "nixl" or spec.world_size != 1:
        raise ValueError(f"--pack-for-tp needs --transport nixl and a one-rank prefill worker "
                         f"(got {spec.transport}, tp={spec.tensor_parallel_size} x pp={spec.pipeline_parallel_size})")
    try:
        pack_target(engine, config.transfer.pack_for_tp)  # a TP size the model's kv heads fit
    except ValueError as exc:
        if not spec.pack_for_tp_auto:
            raise
        # the cluster's largest decode TP cannot hold this model (nor could that decode group):
        # keep the arena for the TP sizes the router names per request that do fit
        log.warning("--pack-for-tp auto: %s; packing only for decode TP sizes that fit", exc)
    return arena_bytes(engine)


def build_engine(spec: WorkerSpec) -> Engine:
    if spec.engine == "sim":
        from splitserve.engine.sim_engine import build_sim_engine

        return build_sim_engine(spec.model, spec.role, spec.sim, spec.engine_options)
    config = build_engine_config(
        spec.model,
        role=spec.role,
        tensor_parallel_size=spec.tensor_parallel_size,
        pipeline_parallel_size=spec.pipeline_parallel_size,
        **spec.engine_options,
    )
    return Engine(config, seed=spec.seed)


HooksFactory = Callable[[Engine, TransportEndpoint, "dict[int, RankEndpoint] | None"], dict[str, Any]]


def _expose(engine: Engine, transport: TransportEndpoint, address: str) -> dict[int, RankEndpoint] | None:
    """Expose this rank's KV pool (and a hybrid model's recurrent state, first: NIXL's agent
    metadata must cover it); rank 0 gets every rank's endpoint (a collective)."""
    state_metadata = expose_state(engine, transport)
    metadata = transport.expose(engine.kv_caches)
    gathered = engine.ps.gather_to_first((address, metadata, state_metadata))
    if gathered is None:
        return None
    return {r: RankEndpoint(r, addr, meta, state) for r, (addr, meta, state) in enumerate(gathered)}


def _lifecycle_handlers(spec: WorkerSpec, transport: TransportEndpoint, state: Any) -> dict[str, Any]:
    """suspend / resume / reload, run on every rank. After a resume the KV memory
    is new, so it is exposed again and rank 0 publishes the new endpoints."""
    from splitserve.engine import lifecycle

    def suspend(engine: Engine, command) -> None:
        transport.unexpose()
        lifecycle.suspend(engine)

    def resume(engine: Engine, command) -> None:
        lifecycle.resume(engine)
        endpoints = _expose(engine, transport, spec.address)
        if endpoints is not None and hasattr(state, "endpoints"):
            state.endpoints = endpoints

    def reload(engine: Engine, command) -> None:
        lifecycle.reload_weights(engine, *command.args)

    return {"suspend": suspend, "resume": resume, "reload_weights": reload}


def _kv_event_hooks(engine: Engine, publisher, after_step):
    """Rank 0 with a publisher: every step's block events go out on the PUB socket,
    and `block_set` answers from the same thread right after publishing, so the
    set matches `event_sequence` exactly. Other ranks record no events."""
    from splitserve.proto.v1 import prefill_worker_pb2

    engine.pool.record_events = publisher is not None

    def after(engine: Engine, outputs) -> None:
        if after_step is not None:
            after_step(engine, outputs)
        if publisher is not None:
            publisher.publish(engine.pool.drain_events())

    def block_set(engine: Engine, command):
        if publisher is None:
            return prefill_worker_pb2.BlockSet(block_digests=engine.pool.cached_hashes(), block_size=engine.block_size)
        publisher.publish(engine.pool.drain_events())
        return publisher.block_set(engine.pool.cached_hashes())

    return after, block_set


def _build_rank(
    spec: WorkerSpec, hooks_factory: HooksFactory, publisher=None
) -> tuple[Engine, TransportEndpoint, EngineLoop, Any]:
    engine = build_engine(spec)
    transport = make_transport("sim" if spec.engine == "sim" else spec.transport, spec.role, _pack_arena_bytes(spec, engine))
    hooks = hooks_factory(engine, transport, _expose(engine, transport, spec.address))
    state = hooks.get("state")
    after_step, block_set = _kv_event_hooks(engine, publisher, hooks.get("after_step"))
    loop = EngineLoop(
        engine,
        on_outputs=hooks.get("on_outputs"),
        after_step=after_step,
        handlers={
            **_lifecycle_handlers(spec, transport, state),
            **(hooks.get("handlers") or {}),
            "block_set": block_set,
            "integrity": lambda e, c: check_integrity(e),
            "warm_up": lambda e, c: warm_up(e),
        },
        housekeeping=hooks.get("housekeeping"),
    )
    return engine, transport, loop, state


def _group_on_cuda(spec: WorkerSpec) -> bool:
    """NCCL or gloo for the group: `devices.group_on_cuda` of the engines' `--device`; a CUDA
    group with more ranks than GPUs raises ValueError (WorkerGroup asks first, at start)."""
    from splitserve.engine.devices import group_on_cuda

    device = str(spec.engine_options.get("device", "auto"))
    return group_on_cuda(device, spec.tensor_parallel_size, spec.pipeline_parallel_size)


def _follow_rank_zero(rank_zero_pid: int, poll_s: float = 1.0) -> None:
    """A non-zero rank lives and dies with rank 0. SIGTERM and SIGINT — a supervisor signalling
    the worker's process group (`splitserve up`, a pod's shell), Ctrl-C in a terminal — are rank
    0's to handle: it drains, and its drain needs every rank (each command and step is a
    collective), then stops them with a "stop" command. So they are ignored here; should rank 0
    die without that, a watchdog thread ends this rank, which would otherwise wait in its next
    collective. (Not PR_SET_PDEATHSIG: it follows the thread that started the rank, and rank 0
    starts its ranks from a worker thread of its event loop.)"""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == rank_zero_pid:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="rank-zero-watchdog", daemon=True).start()


def _other_rank_main(rank: int, world: int, init_method: str, spec: WorkerSpec, hooks_factory: HooksFactory,
                     rank_zero_pid: int) -> None:
    _follow_rank_zero(rank_zero_pid)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    torch.set_num_threads(1)
    use_cuda = _group_on_cuda(spec)
    if use_cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=init_method, rank=rank, world_size=world)
    _, transport, loop, _ = _build_rank(spec, hooks_factory)
    try:
        loop.run()
    finally:
        transport.close()
        dist.destroy_process_group()


class WorkerGroup:
    """Rank 0's handle on the whole group: starts the other ranks, builds the
    local engine, and runs the loop on a background thread."""

    def __init__(self, spec: WorkerSpec, hooks_factory: HooksFactory, publisher=None):
        """`publisher`: a KVEventPublisher (engine/kv_events.py) for rank 0's block events, or None."""
        on_cuda = _group_on_cuda(spec)  # refuses a CUDA group with too few GPUs before anything starts
        self.spec = spec
        self.draining = False
        """Set by a drain: the services refuse new requests but finish the rest."""
        self.num_in_flight = 0
        """Requests a service is handling (maintained by the services, on their event loop)."""
        self._procs: list[Any] = []
        self._tmp = tempfile.TemporaryDirectory(prefix="splitserve-group-")
        world = spec.world_size
        if world > 1:
            init_method = f"file://{self._tmp.name}/rendezvous"
            ctx = mp.get_context("spawn")
            for rank in range(1, world):
                p = ctx.Process(
                    target=_other_rank_main, args=(rank, world, init_method, spec, hooks_factory, os.getpid()),
                    daemon=True,
                )
                p.start()
                self._procs.append(p)
            dist.init_process_group("nccl" if on_cuda else "gloo", init_method=init_method, rank=0,
                                    world_size=world)
        self.engine, self.transport, self.loop, self.state = _build_rank(spec, hooks_factory, publisher)
        self.metrics = WorkerMetrics(spec.role, self.engine)
        """Prometheus metrics of this worker (served by worker_server.py with --metrics-port)."""
        self.has_crashed = False
        """The engine loop died of an exception: nothing in flight will finish (see `on_crash`)."""
        self.on_crash: Callable[[], None] | None = None
        """Called from the engine thread right after a crash (worker_server.py stops the worker)."""
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def warm_up(self):
        """Run `engine.warmup.warm_up` on every rank (an engine command; blocks until done) and
        return rank 0's `WarmUpReport`. Before the worker serves: it needs an idle engine."""
        return self.loop.submit(Command("warm_up")).result()

    def _run(self) -> None:
        try:
            self.loop.run()
        except Exception:
            log.exception("engine loop crashed")
            self.has_crashed = True
            if self.on_crash is not None:
                self.on_crash()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every rank's loop and wait for them (idempotent)."""
        if self.loop.is_running:
            self.loop.stop()
        self._thread.join(timeout=timeout_s)
        for p in self._procs:
            p.join(timeout=timeout_s)
            if p.is_alive():
                p.kill()
        self._procs = []
        self.transport.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._tmp.cleanup()
