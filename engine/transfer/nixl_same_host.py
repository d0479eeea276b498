"""NIXL's same-host GPU shortcut: a NIXL source rank whose KV lives in VRAM also publishes CUDA
IPC handles of its pool and the identity of its host; a destination on the same host with its
own pool in VRAM maps the source's pool and copies with our kernel (`cuda_ipc.py`) instead of
issuing NIXL READs.

Why: NIXL/UCX moves VRAM between two processes on one GPU with the CUDA driver's copies on UCX's
streams, 12-29% of a device copy on the H200 (230-590 GB/s; 0.5 GB/s before cuda_ipc reads were
turned on, `nixl_agent.py`), while the mapped-pool kernel copy reaches 87-96% (benchmarks/
RESULTS.md, 2026-12-03). With the shortcut the default transport is the fast one on one host,
and a deployment does not have to know which pairs share a host: across hosts, or where CUDA IPC
cannot map the peer (other containers without a shared IPC namespace, GPUs without peer access),
the pull goes over NIXL as before — a failed mapping is remembered per source and not retried.

Host identity is the kernel's boot id and the host name: two processes with equal values run on
one kernel (a mapping may still fail, see above). `SPLITSERVE_NIXL_CUDA_IPC=0` turns the shortcut
off (NIXL for everything: A/B runs, or a platform where mapping misbehaves).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping, Sequence

import torch

from splitserve.engine.transfer.nixl_endpoint import NixlEndpoint
from splitserve.engine.transfer.plan import TransferPlan
from splitserve.engine.transfer.transport import TransferError, TransferStats

log = logging.getLogger(__name__)


def host_identity() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:  # not Linux: never claim to share a host
        return ""
    return f"{boot}/{socket.gethostname()}"


def enabled() -> bool:
    return os.environ.get("SPLITSERVE_NIXL_CUDA_IPC", "1") != "0"


def publish(kv_tensors: Sequence[torch.Tensor]) -> tuple[str, str]:
    """(host identity, `CudaIpcTransport.expose`'s JSON) for a VRAM pool; ("", "") for a CPU
    pool, with the shortcut off, or for a pool torch cannot share over CUDA IPC."""
    if not enabled() or not kv_tensors[0].is_cuda:
        return "", ""
    host = host_identity()
    if not host:
        return "", ""
    from splitserve.engine.transfer.cuda_ipc import CudaIpcTransport

    try:
        return host, CudaIpcTransport().expose(kv_tensors).decode()
    except Exception:  # e.g. memory from an allocator CUDA IPC cannot export: NIXL only
        return "", ""


class SameHostPath:
    """The destination side: pulls whole plans through mapped peer pools when every source of
    the plan is on this host and mappable."""

    def __init__(self) -> None:
        self._ipc = None
        self._enabled = enabled()
        """Read once: `SPLITSERVE_NIXL_CUDA_IPC` is a start-time switch (an environment lookup per
        pull was ~0.7 µs)."""
        self._host = host_identity()
        self._failed: set[str] = set()  # published handles whose mapping failed once
        self.pulls = 0
        """Pulls served by the shortcut (the tests read it)."""

    def pull(self, plan: TransferPlan, dst_rank: int, sources: Mapping[int, NixlEndpoint],
             kv_tensors: Sequence[torch.Tensor], start: float) -> TransferStats | None:
        """The pull done over CUDA IPC (timed from `start`, a `time.perf_counter()`), or None
        (nothing done) when some source is elsewhere, unmappable, or the destination pool is not
        in VRAM. `sources`: the plan's source ranks for `dst_rank`, each one's parsed endpoint."""
        if not (self._enabled and self._host and kv_tensors[0].is_cuda):
            return None
        for ep in sources.values():
            if not ep.ipc_handles or ep.ipc_host != self._host or ep.ipc_handles in self._failed:
                return None
        if self._ipc is None:
            from splitserve.engine.transfer.cuda_ipc import CudaIpcTransport

            self._ipc = CudaIpcTransport()
        mapped = {}
        for rank, ep in sources.items():  # map first: a failure falls back before anything is copied
            try:
                # a parsed endpoint is reused (NixlTransport._parse): its handles' hash is cached
                mapped[rank] = self._ipc.open(ep.ipc_handles)
            except TransferError as exc:
                self._failed.add(ep.ipc_handles)
                log.warning("a same-host source's KV pool cannot be mapped over CUDA IPC (%s); "
                            "pulling it with NIXL reads instead", exc)
                return None
        stats = self._ipc.pull_mapped(plan, dst_rank, mapped, kv_tensors, start)
        self.pulls += 1
        return stats

    def close(self) -> None:
        if self._ipc is not None:
            self._ipc.close()
