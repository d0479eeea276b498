"""NIXL (UCX backend) pull transport: DRAM for CPU tensors, VRAM for GPU tensors.

    source rank                                    destination rank
    agent.register_memory(kv[i] for each layer)    agent.register_memory(its own kv[i])
    meta = NixlEndpoint(agent metadata,            agent.add_remote_agent(meta.agent_metadata)
                        layer addresses).to_bytes  per source: one READ request over all regions
                        ── bytes over our gRPC ──▶   (plan → regions.py → Nx3 descriptor arrays)
                                                   poll until DONE, error, or the deadline

No NIXL listener thread and no etcd: metadata only travels as bytes the caller carries (the
listener binds 0.0.0.0). UCX is pointed at loopback (`UCX_NET_DEVICES=lo`) unless the
environment already says otherwise; set it before the first agent is created in the process.
Leave `UCX_TLS` unset on one host: UCX then moves DRAM through shared memory (~4x faster than
`UCX_TLS=tcp,self` here); a list without a wire-up transport (e.g. `sm,self`) fails to start.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from splitserve.engine.host_memory import huge_page_empty
from splitserve.engine.transfer import nixl_same_host as same_host
from splitserve.engine.transfer.kv_tensors import HeldPoolCheck
from splitserve.engine.transfer.layout import KVLayout
from splitserve.engine.transfer.nixl_agent import (
    PROGRESS_DELAY_US,
    apply_env_defaults,
    create_agent,
    nixl_api,
)
from splitserve.engine.transfer.nixl_endpoint import NixlEndpoint
from splitserve.engine.transfer.nixl_packed_source import NixlPackedSource
from splitserve.engine.transfer.nixl_staging import should_stage, staged_pull
from splitserve.engine.transfer.plan import TransferPlan
from splitserve.engine.transfer.progress import NUM_BOARD_SLOTS, ProgressBoard
from splitserve.engine.transfer.regions import Regions, ops_regions
from splitserve.engine.transfer.source_pack import PackArena, PackJob, packed_regions
from splitserve.engine.transfer.transport import (
    KVTransport,
    TransferError,
    TransferStats,
    TransferTimeout,
    needed_sources,
)

POLL_SPIN_S = 0.002
"""How long a wait polls NIXL back to back before it naps between polls (seconds)."""


def _mem(t: torch.Tensor) -> tuple[str, int]:
    return ("VRAM", t.get_device()) if t.is_cuda else ("DRAM", 0)


class NixlTransport(NixlPackedSource, KVTransport):
    """One NIXL agent per worker rank. Not thread-safe."""

    kind = "nixl"

    def __init__(self, name: str | None = None, num_threads: int = 0, poll_sleep_s: float = 0.0002,
                 num_board_slots: int = NUM_BOARD_SLOTS, stage_reshards: bool = True, progress_thread: bool = True,
                 progress_delay_us: int | None = None, pack_arena_bytes: int = 0):
        """`progress_thread`: NIXL's UCX progress thread. A side that others read from needs it
        (UCX emulates a read over TCP with messages the owner must answer, and answers connection
        setup); a side that only pulls does not — it progresses its worker itself while it polls
        its own reads — so decode workers run without it. `progress_delay_us` (default
        `PROGRESS_DELAY_US`): the thread's poll timeout; NIXL's own 0 spins a core, which doubled
        a prefill's compute time on a shared core (benchmarks/RESULTS.md, 2026-12-02).
        `pack_arena_bytes`: memory a source rank registers for source-packed reshards
        (`source_pack.py`, `pack_begin`); 0 = none, destinations read head slices from the pool."""
        apply_env_defaults()
        nixl_agent, nixl_agent_config = nixl_api()
        self.name = name or f"splitserve-{uuid.uuid4().hex[:12]}"
        config = nixl_agent_config(enable_prog_thread=progress_thread, enable_listen_thread=False,
                                   num_threads=num_threads, backends=["UCX"])
        ucx_env = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
        if progress_delay_us is None:
            raw = os.environ.get("SPLITSERVE_NIXL_PROGRESS_DELAY_US", "")
            try:
                progress_delay_us = int(raw) if raw.strip() else PROGRESS_DELAY_US
            except ValueError:
                raise ValueError(f"SPLITSERVE_NIXL_PROGRESS_DELAY_US must be whole microseconds, got {raw!r}") from None
        try:
            self._agent = create_agent(nixl_agent, self.name, config, progress_delay_us if progress_thread else 0)
        except Exception as exc:  # e.g. nixlBackendError when UCX_TLS leaves UCX no usable transport
            raise TransferError(f"NIXL agent {self.name}: creating the UCX backend failed ({exc!r}) "
                                f"with UCX environment {ucx_env}") from exc
        if "UCX" not in self._agent.backends:
            raise TransferError(f"NIXL agent {self.name}: the UCX backend is unavailable "
                                f"(plugins: {self._agent.get_plugin_list()}, UCX environment {ucx_env})")
        self._poll_sleep_s = poll_sleep_s
        self._num_board_slots = num_board_slots
        self._stage_reshards = stage_reshards
        self._staging: list[torch.Tensor] = []  # nixl_staging.py: two registered uint8 buffers
        self._staging_device = torch.device("cpu")
        self._registered: dict[tuple[int, int], object] = {}  # (addr, nbytes) -> reg descs
        self._remote_names: dict[bytes, str] = {}  # agent metadata -> agent name
        self._endpoints: dict[bytes, NixlEndpoint] = {}  # endpoint metadata -> parsed (_parse)
        self._endpoints_ok: dict[tuple[int, int], tuple[NixlEndpoint, KVLayout]] = {}  # checks passed
        self._check_dst = HeldPoolCheck()  # the destination pool, pull after pull
        self._rows: dict[int, torch.Tensor] = {}  # width -> registered landing row of board reads
        self._pack_arena_bytes = int(pack_arena_bytes)
        self._arena: PackArena | None = None
        self._jobs: dict[str, PackJob] = {}
        self._endpoint: NixlEndpoint | None = None
        self._same_host = same_host.SameHostPath()
        self._closed = False

    def _register(self, kv_tensors: Sequence[torch.Tensor]) -> None:
        for t in kv_tensors:
            key = (t.data_ptr(), t.numel() * t.element_size())
            if key not in self._registered:
                self._registered[key] = self._agent.register_memory(t)

    def expose(self, kv_tensors: Sequence[torch.Tensor]) -> bytes:
        if not kv_tensors or not all(t.is_contiguous() for t in kv_tensors):
            raise ValueError("expose needs a non-empty list of contiguous KV tensors")
        board = ProgressBoard.for_pool(kv_tensors, self._num_board_slots)
        if self.board is None or self.board.shape != board.shape:  # exposed again: keep live slots
            self.board = board
        arena = self._arena_on(kv_tensors[0].device)
        self._register([*kv_tensors, self.board.tensor, *arena])  # before taking the metadata: it covers all
        mem_type, device_id = _mem(kv_tensors[0])
        ipc_host, ipc_handles = same_host.publish(kv_tensors)
        self._endpoint = NixlEndpoint(
            agent_metadata=self._agent.get_agent_metadata(), mem_type=mem_type, device_id=device_id,
            layer_addrs=tuple(t.data_ptr() for t in kv_tensors), layer_shape=tuple(kv_tensors[0].shape),
            dtype=str(kv_tensors[0].dtype).removeprefix("torch."), board_addr=self.board.tensor.data_ptr(),
            board_slots=self.board.shape.num_slots, board_width=self.board.shape.width,
            ipc_host=ipc_host, ipc_handles=ipc_handles,
        )
        return self._endpoint.to_bytes()

    def _parse(self, metadata: bytes) -> NixlEndpoint:
        """`NixlEndpoint.from_bytes`, remembered per metadata: a VRAM source's header carries its
        CUDA IPC handles (~13 KB of JSON at 16 layers), and parsing it per pull measured ~0.1 ms
        on the H200 host, as long as the same-host copy of an 8k-token prompt itself."""
        ep = self._endpoints.get(metadata)
        if ep is None:
            ep = NixlEndpoint.from_bytes(metadata)
            if len(self._endpoints) >= 64:
                self._endpoints.clear()
            self._endpoints[bytes(metadata)] = ep
        return ep

    def _remote_agent(self, agent_metadata: bytes) -> str:
        """The name NIXL gave the peer agent, added once per metadata. Keyed by the metadata
        itself: it comes from a remembered parsed endpoint (`_parse`), whose bytes object keeps
        its hash, where a digest was computed per pull."""
        name = self._remote_names.get(agent_metadata)
        if name is None:
            name = self._agent.add_remote_agent(agent_metadata)
            name = self._remote_names[bytes(agent_metadata)] = name.decode() if isinstance(name, bytes) else name
        return name

    def pull(
        self,
        plan: TransferPlan,
        dst_rank: int,
        remote: Mapping[int, bytes],
        kv_tensors: Sequence[torch.Tensor],
        timeout_s: float = 30.0,
    ) -> TransferStats:
        if self._closed:
            raise TransferError(f"NIXL agent {self.name} is closed")
        start = time.perf_counter()
        dst_pool = self._check_dst(kv_tensors, plan.dst, dst_rank)
        endpoints = {rank: self._parse(remote[rank]) for rank in needed_sources(plan, dst_rank, remote)}
        for src_rank, ep in endpoints.items():
            passed = self._endpoints_ok.get((id(ep), src_rank))  # parsed endpoints are reused (_parse)
            if passed is None or passed[0] is not ep or not (passed[1] is plan.src or passed[1] == plan.src):
                self._check_endpoint(ep, plan, src_rank)
                if len(self._endpoints_ok) >= 64:
                    self._endpoints_ok.clear()
                self._endpoints_ok[(id(ep), src_rank)] = (ep, plan.src)
        shortcut = self._same_host.pull(plan, dst_rank, endpoints, kv_tensors, start)
        if shortcut is not None:  # every source on this host, VRAM to VRAM: mapped over CUDA IPC
            return shortcut
        deadline = time.monotonic() + timeout_s
        self._register(kv_tensors)
        self._staging_device = kv_tensors[0].device
        local_mem, local_dev = _mem(kv_tensors[0])
        local_addrs = np.asarray([t.data_ptr() for t in kv_tensors], dtype=np.int64)
        pending: dict[object, object] = {}
        num_bytes = num_regions = 0

        def post(key, ep: NixlEndpoint, regions: Regions, local_starts: np.ndarray, absolute: bool = False) -> None:
            local = np.stack([local_starts + regions.dst_offset, regions.num_bytes,
                              np.full(len(regions), local_dev)], axis=1).astype(np.uint64)
            far_starts = 0 if absolute else np.asarray(ep.layer_addrs, dtype=np.int64)[regions.src_layer]
            far = np.stack([far_starts + regions.src_offset,
                            regions.num_bytes, np.full(len(regions), ep.device_id)], axis=1).astype(np.uint64)
            handle = self._agent.initialize_xfer(
                "READ", self._agent.get_xfer_descs(local, local_mem),
                self._agent.get_xfer_descs(far, ep.mem_type), self._remote_agent(ep.agent_metadata))
            if self._agent.transfer(handle) == "ERR":
                handle.release()
                raise TransferError(f"NIXL read from source rank {key[0]} failed to start")
            pending[key] = handle

        def done(key) -> None:
            self._wait({key[0]: pending[key]}, deadline, timeout_s)
            pending.pop(key).release()

        try:
            staged: list[tuple[int, NixlEndpoint, list]] = []
            for src_rank, ep in endpoints.items():
                ops = plan.ops_for_pair(src_rank, dst_rank)
                if ep.packed is not None:  # slices the source packed: contiguous reads of its arena
                    found = [(op, packed_regions(op, plan.src, plan.dst, dst_pool, ep.packed)) for op in ops]
                    packed = Regions.concat(r for _, r in found if r is not None)
                    if len(packed):
                        post((src_rank, "packed"), ep, packed, local_addrs[packed.dst_layer], absolute=True)
                        num_bytes += packed.bytes_total
                        num_regions += len(packed)
                    ops = tuple(op for op, r in found if r is None)
                stage = [op for op in ops if self._stage_reshards and should_stage(op, plan.src)]
                direct = [op for op in ops if op not in stage]
                if direct:  # posted first: they run while the staged chunks are read and cut
                    regions = ops_regions(direct, plan.src, plan.dst, ep.layer_shape[1], dst_pool)
                    post((src_rank, "direct"), ep, regions, local_addrs[regions.dst_layer])
                    num_bytes += regions.bytes_total
                    num_regions += len(regions)
                if stage:
                    staged.append((src_rank, ep, stage))
            for src_rank, ep, ops in staged:
                def post_chunk(regions, offsets, buf, src_rank=src_rank, ep=ep):
                    post((src_rank, buf.data_ptr()), ep, regions, buf.data_ptr() + offsets[regions.dst_layer])
                    return (src_rank, buf.data_ptr())

                moved, regions_used = staged_pull(ops, plan.src, ep.layer_shape[1], self._staging_buffers,
                                                  post_chunk, done, kv_tensors)
                num_bytes += moved
                num_regions += regions_used
            # What is left: one direct read per source, waited on together (errors name them all).
            self._wait({key[0]: handle for key, handle in pending.items()}, deadline, timeout_s)
        finally:
            for handle in pending.values():
                try:
                    handle.release()
                except Exception:  # an unabortable transfer: NIXL keeps it on its leak list
                    pass
        return TransferStats(num_bytes, time.perf_counter() - start, num_regions)

    def _staging_buffers(self, nbytes: int) -> list[torch.Tensor]:
        """Two registered staging buffers of at least `nbytes` on the pool's device (reused)."""
        if self._staging and self._staging[0].numel() >= nbytes:
            return self._staging
        for buf in self._staging:
            self._agent.deregister_memory(self._registered.pop((buf.data_ptr(), buf.numel())))
        device = self._staging_device
        self._staging = [torch.empty(nbytes, dtype=torch.uint8, device=device) if device.type == "cuda"
                         else huge_page_empty(nbytes, torch.uint8) for _ in range(2)]
        self._register(self._staging)
        return self._staging

    def read_board(self, metadata: bytes, slot: int, width: int, timeout_s: float = 5.0) -> list[int]:
        ep = NixlEndpoint.from_bytes(metadata)
        if not ep.board_addr or ep.board_width != width or not 0 <= slot < ep.board_slots:
            raise TransferError(f"progress board [{ep.board_slots}, {ep.board_width}] has no slot {slot} "
                                f"of width {width}")
        row = self._rows.get(width)
        if row is None:  # one registered landing row per width, reused for every poll
            row = self._rows[width] = torch.zeros(width, dtype=torch.int64)
            self._register([row])
        nbytes = width * 8
        local = np.asarray([[row.data_ptr(), nbytes, 0]], dtype=np.uint64)
        far = np.asarray([[ep.board_addr + slot * nbytes, nbytes, 0]], dtype=np.uint64)
        handle = self._agent.initialize_xfer(
            "READ", self._agent.get_xfer_descs(local, "DRAM"), self._agent.get_xfer_descs(far, "DRAM"),
            self._remote_agent(ep.agent_metadata))
        try:
            if self._agent.transfer(handle) == "ERR":
                raise TransferError("NIXL read of a progress board failed to start")
            self._wait({-1: handle}, time.monotonic() + timeout_s, timeout_s)
        finally:
            handle.release()
        return row.tolist()

    def _wait(self, pending: dict[int, object], deadline: float, timeout_s: float) -> None:
        """Poll until every handle is done. The first `POLL_SPIN_S` poll back to back, then with
        `poll_sleep_s` naps: a VRAM read over cuda_ipc finishes in ~0.1-0.6 ms (an 8k-32k-token
        handoff), and one nap (a 0.2 ms `sleep` is ~0.25 ms) would add as much again."""
        waiting = dict(pending)
        spin_until = time.monotonic() + POLL_SPIN_S
        while waiting:
            for src_rank, handle in list(waiting.items()):
                state = self._agent.check_xfer_state(handle)
                if state == "DONE":
                    del waiting[src_rank]
                elif state == "ERR":
                    raise TransferError(f"NIXL read from source rank {src_rank} failed")
            if waiting and time.monotonic() > deadline:
                raise TransferTimeout(
                    f"NIXL read from source ranks {sorted(waiting)} not done after {timeout_s:.1f}s")
            if waiting and self._poll_sleep_s and time.monotonic() > spin_until:
                time.sleep(self._poll_sleep_s)

    @staticmethod
    def _check_endpoint(ep: NixlEndpoint, plan: TransferPlan, src_rank: int) -> None:
        expected_layers = plan.src.num_local_layers(plan.src.pp_rank(src_rank))
        if (len(ep.layer_addrs) != expected_layers or ep.layer_shape != plan.src.kv_shape(ep.layer_shape[1])
                or ep.dtype != plan.src.dtype):
            raise ValueError(
                f"source rank {src_rank} exposes {len(ep.layer_addrs)} layers of {ep.layer_shape} {ep.dtype}; "
                f"the plan expects {expected_layers} layers of {plan.src.kv_shape(ep.layer_shape[1])} "
                f"{plan.src.dtype}"
            )

    def unexpose(self) -> None:
        for descs in self._registered.values():
            self._agent.deregister_memory(descs)
        self._registered.clear()
        self._rows.clear()
        self._check_dst.clear()
        self._staging = []
        self._arena = None
        self._jobs.clear()
        self._endpoint = None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._same_host.close()
        for name in self._remote_names.values():
            try:
                self._agent.remove_remote_agent(name)
            except Exception:
                pass
        for descs in self._registered.values():
            self._agent.deregister_memory(descs)
        self._registered.clear()
        self._rows.clear()
        self._staging = []
        self._arena = None
        self._jobs.clear()
        self._remote_names.clear()
        self._agent = None
