"""Process groups joining the ranks of one prefill worker and one decode worker, for
`torch_dist` KV transfers: created on first use, cached per peer, dropped on failure.

One group per (prefill worker, decode worker) pair, `src_world + dst_world` ranks::

    group rank:   0 … src_world-1        src_world … src_world+dst_world-1
                  prefill plan ranks      decode plan ranks

It is built straight from a `FileStore` (a file both workers can open: same host only)
with the backend's constructor — never through `init_process_group` / `new_group`, so
the default group of each worker (its own TP × PP ranks) is untouched and the pair group
is not registered globally (use it through `torch_dist.send_plan`/`recv_plan`, which call
its methods). Gloo binds 127.0.0.1 only; NCCL (CUDA) needs the two workers on different
GPUs (NCCL refuses two ranks on one device) and bootstraps over `NCCL_SOCKET_IFNAME`.

Creating a group is a collective of all its ranks and expensive with NCCL, hence the
cache. A cached group is identified by a `key` that the prefill side chooses: a store
file is used for one group only, so a new key always means a fresh rendezvous.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from splitserve.engine.transfer.transport import TransferError, TransferTimeout

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")


def backend_for(device: torch.device) -> str:
    """The pair-group backend for KV living on `device`."""
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass(frozen=True)
class PairGroupSpec:
    """One rank's view of a pair group to join."""

    key: str
    """Identity of the group; the same on all its ranks, new for every rendezvous."""
    store_path: str
    """The `FileStore` file of the rendezvous (one per key)."""
    rank: int
    """This process's rank in the pair group."""
    world_size: int
    backend: str
    """gloo (CPU KV) or nccl (CUDA KV)."""

    def __post_init__(self) -> None:
        if not self.key or not self.store_path:
            raise ValueError(f"pair group needs a key and a store path, got {self!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"pair group rank {self.rank!r} out of range for world size {self.world_size!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"pair group backend must be one of {BACKENDS}, got {self.backend!r}")


def create_pair_group(spec: PairGroupSpec, device: torch.device, timeout_s: float) -> dist.ProcessGroup:
    """Join the group (blocks until all `world_size` ranks have joined, or `timeout_s`).

    Raises TransferTimeout when the peers do not show up in time, TransferError otherwise.
    """
    timeout = timedelta(seconds=timeout_s)
    start = time.monotonic()
    try:
        store = dist.FileStore(spec.store_path, spec.world_size)
        store.set_timeout(timeout)
        pg = dist.ProcessGroup(store, spec.rank, spec.world_size)
        if spec.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            backend = dist.ProcessGroupGloo(store, spec.rank, spec.world_size, opts)
            kind = dist.ProcessGroup.BackendType.GLOO
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            backend = dist.ProcessGroupNCCL(store, spec.rank, spec.world_size, opts)
            backend.eager_connect_single_device(device)  # init the communicator now, with every rank
            kind = dist.ProcessGroup.BackendType.NCCL
        pg._set_default_backend(kind)
        pg._register_backend(device, kind, backend)
    except Exception as exc:
        if spec.rank == 0:  # a failed rendezvous leaves its keys behind; the key is never reused
            _remove_quietly(spec.store_path)
        waited = time.monotonic() - start
        text = str(exc).lower()
        kind_ = TransferTimeout if "timeout" in text or "timed out" in text or waited >= timeout_s else TransferError
        raise kind_(f"joining pair group {spec.key} as rank {spec.rank}/{spec.world_size} ({spec.backend}) "
                    f"failed after {waited:.1f}s: {exc}") from exc
    log.info("joined pair group %s as rank %d/%d (%s) in %.3fs", spec.key, spec.rank, spec.world_size,
             spec.backend, time.monotonic() - start)
    return pg


def destroy_pair_group(pg: dist.ProcessGroup, backend: str) -> None:
    """Forget a group; NCCL's communicator is aborted so a stuck operation cannot hang the exit."""
    if backend == "nccl":
        try:
            pg.abort()
        except Exception:  # already broken: nothing more to free
            log.debug("aborting an NCCL pair group failed", exc_info=True)


@dataclass
class _Entry:
    spec: PairGroupSpec
    group: dist.ProcessGroup


class PairGroups:
    """This rank's cache of pair groups, one per peer worker, least recently used evicted.

    Not thread-safe: used from the engine loop only. Every rank of a worker sees the same
    sequence of `get`/`drop` calls (they run inside engine commands), so the ranks' caches
    stay identical and a group is created or dropped by all of them together.
    """

    def __init__(self, max_groups: int = 8):
        if max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {max_groups!r}")
        self.max_groups = max_groups
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.num_created = 0
        """Groups this rank has joined so far (reuse keeps it unchanged)."""

    def key_for(self, peer_id: str) -> str | None:
        """The key of the cached group with `peer_id`, if any."""
        entry = self._entries.get(peer_id)
        return entry.spec.key if entry is not None else None

    def get(self, peer_id: str, spec: PairGroupSpec, device: torch.device, timeout_s: float) -> dist.ProcessGroup:
        """The group with `peer_id` named `spec.key`: the cached one, or a new one (a collective:
        every rank of the spec must call it) replacing whatever was cached for that peer."""
        entry = self._entries.get(peer_id)
        if entry is not None and entry.spec == spec:
            self._entries.move_to_end(peer_id)
            return entry.group
        self.drop(peer_id)
        group = create_pair_group(spec, device, timeout_s)
        self.num_created += 1
        self._entries[peer_id] = _Entry(spec, group)
        while len(self._entries) > self.max_groups:
            old_peer, _ = next(iter(self._entries.items()))
            log.info("evicting the pair group with %s (cache of %d)", old_peer, self.max_groups)
            self.drop(old_peer)
        return group

    def drop(self, peer_id: str) -> None:
        """Forget the group with `peer_id` (after a failure its message stream may be out of step)."""
        entry = self._entries.pop(peer_id, None)
        if entry is not None:
            destroy_pair_group(entry.group, entry.spec.backend)
            if entry.spec.rank == 0:
                _remove_quietly(entry.spec.store_path)

    def close(self) -> None:
        for peer_id in list(self._entries):
            self.drop(peer_id)

    def __len__(self) -> int:
        return len(self._entries)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
