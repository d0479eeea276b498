"""The source side of packed reshards over NIXL: a mixin of `NixlTransport` that owns the
registered pack arena and the requests packed in it (source_pack.py says what is packed and
why; engine/handoff_pack.py decides when). The destination side is `packed_regions`, used by
`NixlTransport.pull`.

The mixin uses the transport's `_endpoint` (set by `expose`) and keeps `_pack_arena_bytes`,
`_arena` and `_jobs`, which `NixlTransport.__init__` sets and `unexpose` / `close` clear.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from splitserve.engine.host_memory import huge_page_empty
from splitserve.engine.transfer.kv_tensors import torch_dtype
from splitserve.engine.transfer.layout import KVLayout
from splitserve.engine.transfer.source_pack import PackArena, pack_groups, pack_layers, start_job
from splitserve.engine.transfer.transport import TransferError


class NixlPackedSource:
    """Packed-memory methods of a NIXL source rank (`pack_arena_bytes` > 0)."""

    def _arena_on(self, device: torch.device) -> list[torch.Tensor]:
        """The pack arena on `device` (allocated on first use or when the pool moved; the packs
        of the old one are dropped), as the list of tensors `expose` registers."""
        if self._pack_arena_bytes and (self._arena is None or self._arena.tensor.device != device):
            self._jobs.clear()
            self._arena = PackArena(torch.empty(self._pack_arena_bytes, dtype=torch.uint8, device=device)
                                    if device.type == "cuda" else huge_page_empty(self._pack_arena_bytes, torch.uint8))
        return [self._arena.tensor] if self._arena is not None else []

    def pack_begin(self, request_id: str, src: KVLayout, dst: KVLayout, src_rank: int,
                   block_ids: Sequence[int]) -> bool:
        """Reserve arena room to pack `request_id`'s head slices that layout `dst` reads strided
        from this rank. False (nothing reserved) when no slice is strided, there is no arena, or
        it is full: the destination then reads the pool. Layers are packed by `pack_layers`."""
        if self._arena is None or self._endpoint is None or request_id in self._jobs:
            return request_id in self._jobs
        groups = pack_groups(src, dst, src_rank)
        if not groups or not block_ids:
            return False
        num_layers = src.num_local_layers(src.pp_rank(src_rank))
        job = start_job(self._arena, src, groups, num_layers, block_ids, torch_dtype(src))
        if job is None:
            return False
        self._jobs[request_id] = job
        return True

    def pack_layers(self, request_id: str, kv_tensors: Sequence[torch.Tensor], start: int, end: int) -> None:
        """Pack local layers [start, end) of a request `pack_begin` accepted (a no-op otherwise).
        Publish a layer (board mark, descriptor) only after it is packed."""
        job = self._jobs.get(request_id)
        if job is not None:
            pack_layers(job, kv_tensors, start, end)
            if kv_tensors[0].is_cuda:
                torch.cuda.current_stream(kv_tensors[0].device).synchronize()

    def packed_metadata(self, request_id: str) -> bytes:
        """This rank's endpoint bytes for `request_id`: with its packed slices when it has them."""
        if self._endpoint is None:
            raise TransferError(f"NIXL agent {self.name} has exposed nothing")
        job = self._jobs.get(request_id)
        return (self._endpoint if job is None else replace(self._endpoint, packed=job.packed)).to_bytes()

    def pack_release(self, request_id: str) -> None:
        """Free a request's packed slices (on the destination's acknowledgement, cancel, or lease
        expiry — the same moments its pool blocks are unpinned). Idempotent."""
        job = self._jobs.pop(request_id, None)
        if job is not None and self._arena is not None:
            for start, nbytes in job.spans:
                self._arena.free(start, nbytes)

    def packed_requests(self) -> list[str]:
        """Requests holding packed memory (until `pack_release`)."""
        return list(self._jobs)

    def layers_packed(self, request_id: str) -> int:
        """Local layers of a request packed so far (0: none, or not packing it)."""
        job = self._jobs.get(request_id)
        return 0 if job is None else job.layers_packed
