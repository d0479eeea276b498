"""Prefill side of source-packed reshards (`TransferConfig.pack_for_tp`, NIXL only): pack each
handoff's head slices for the decode pool's TP size as the layers are written, and publish the
packed endpoint in the preview and the descriptor (engine/transfer/source_pack.py says why).

    forward pass of a prompt's last chunk starts ─▶ begin(request)   (arena room, or no packing)
    layer i written ─▶ layers(request, i, i + 1) ─▶ board mark i      (pack before publishing)
    step end ─▶ finish(request): any layer not packed yet ─▶ descriptor with `endpoints(request)`
    after every step ─▶ release_done(): packs of requests whose pins are gone (ack, abort, lease)

Which TP to pack for is decided per request: the router names the decode worker's TP size in
`PrefillRequest.decode_tp` (the service records it in `PrefillState.decode_tp`); a request without
one is packed for `pack_for_tp`. `--pack-for-tp auto` (the CLI's default, `resolve_pack_for_tp`)
turns the arena on only where the cluster's shard spec has a decode group of a larger TP size, so
clusters without reshards pay nothing.

A decode worker of another TP size, or an arena that is full, reads the pool as before (the pull
matches packed slices by head range and falls back op by op), so packing never decides
correctness; the descriptor's block checksums verify every import either way. Single-rank prefill
groups only: rank 0 publishes every rank's endpoint, and only its own arena offsets are known here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

from splitserve.engine.handoff import RankEndpoint, engine_layout
from splitserve.engine.transfer.layout import KVLayout

log = logging.getLogger(__name__)

PACK_AUTO = "auto"


def resolve_pack_for_tp(value: int | str, *, role: str, transport: str, world_size: int,
                        decode_tps: Sequence[int] | None) -> int:
    """`--pack-for-tp` as an int. `auto`: the largest decode TP of the cluster's shard spec
    (`decode_tps`, None without a control plane) when this is a one-rank NIXL prefill worker and
    that TP is above 1 (its ranks take head slices, read strided from an unpacked pool); else 0."""
    if value != PACK_AUTO:
        return value
    if role != "prefill" or transport != "nixl" or world_size != 1 or not decode_tps:
        return 0
    return max(decode_tps) if max(decode_tps) > 1 else 0


def pack_target(engine, dst_tp: int) -> KVLayout:
    """The decode layout packed for: the engine's own, at TP `dst_tp`, one PP stage (PP does not
    change which head slices are read). ValueError when the model's kv heads do not fit `dst_tp`."""
    src = engine_layout(engine)
    try:
        return dataclasses.replace(src, tp=dst_tp, pp=1, layer_ranges=())
    except ValueError as exc:
        raise ValueError(f"pack_for_tp={dst_tp} does not fit this model: {exc}") from None


def arena_bytes(engine, fraction: float = 0.25) -> int:
    """Packed memory of a prefill rank: `fraction` of its KV pool (handoffs beyond it are not packed)."""
    return int(fraction * sum(t.numel() * t.element_size() for t in engine.kv_caches))


def make_packer(engine, transport, target_tp: Callable[[str], int] | None = None) -> HandoffPacker | None:
    """The packer of a prefill rank whose transport has packed memory (`--pack-for-tp`), else None.
    `target_tp(request_id)`: the decode TP the router named for the request (0 = none)."""
    config = getattr(engine, "config", None)
    if config is None or not config.transfer.pack_for_tp or not hasattr(transport, "pack_begin"):
        return None
    return HandoffPacker(engine, transport, config.transfer.pack_for_tp, target_tp)


class HandoffPacker:
    """Owned by the engine thread of a single-rank prefill group whose transport is NIXL."""

    def __init__(self, engine, transport, default_tp: int, target_tp: Callable[[str], int] | None = None):
        self.engine = engine
        self.transport = transport
        self.src = engine_layout(engine)
        self.default_tp = default_tp
        self._target_tp = target_tp or (lambda request_id: 0)
        self._layouts: dict[int, KVLayout | None] = {}  # per decode TP, worked out (and warned about) once
        self._refused: set[str] = set()

    def target(self, request_id: str) -> KVLayout | None:
        """The decode layout to pack `request_id` for; None: nothing to pack (the same TP as this
        rank, or a TP the model's kv heads do not fit, warned once per TP)."""
        tp = self._target_tp(request_id) or self.default_tp
        if tp not in self._layouts:
            try:
                self._layouts[tp] = pack_target(self.engine, tp)
            except ValueError as exc:
                log.warning("not packing handoffs for decode tp=%d: %s", tp, exc)
                self._layouts[tp] = None
        dst = self._layouts[tp]
        return dst if dst is not None and dst.tp != self.src.tp else None

    def begin(self, request_id: str, block_ids: Sequence[int]) -> bool:
        """Reserve the request's packed memory; False (for good: its preview went out unpacked)
        when the arena is full or nothing is strided."""
        if request_id in self._refused:
            return False
        dst = self.target(request_id)
        if dst is not None and self.transport.pack_begin(request_id, self.src, dst, 0, block_ids):
            return True
        if dst is not None:
            self.release_done()  # packs of pins released since the last step end may hold the room
            if self.transport.pack_begin(request_id, self.src, dst, 0, block_ids):
                return True
        self._refused.add(request_id)
        return False

    def layers(self, request_id: str, start: int, end: int) -> None:
        self.transport.pack_layers(request_id, self.engine.kv_caches, start, end)

    def finish(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Everything packed before the handoff is published (a no-op past `begin`'s refusal)."""
        if self.begin(request_id, block_ids):
            done = self.transport.layers_packed(request_id)
            if done < len(self.engine.kv_caches):
                self.layers(request_id, done, len(self.engine.kv_caches))

    def endpoints(self, request_id: str, endpoints: dict[int, RankEndpoint]) -> dict[int, RankEndpoint]:
        if request_id not in self.transport.packed_requests():
            return endpoints
        return {**endpoints, 0: dataclasses.replace(endpoints[0],
                                                    agent_metadata=self.transport.packed_metadata(request_id))}

    def forget(self, request_id: str) -> None:
        """Drop the request's packing now (an earlier attempt superseded by a retry of its id)."""
        if request_id in self.transport.packed_requests():
            self.transport.pack_release(request_id)
        self._refused.discard(request_id)

    def release_done(self) -> None:
        for request_id in self.transport.packed_requests():
            if request_id not in self.engine.handoffs and not self.engine.has_request(request_id):
                self.transport.pack_release(request_id)
        self._refused = {r for r in self._refused if r in self.engine.handoffs or self.engine.has_request(r)}
