"""The handoff, engine side: the descriptor a prefill engine publishes, and the
importer a decode engine runs to pull and verify it.

    prefill group                                   decode group
    ─────────────                                   ────────────
    request hits its first token -> blocks pinned
    every rank: partial block checksums ─sum─▶ rank 0 builds HandoffDescriptor ──(router)──▶
                                                    every rank: plan = build_plan(src, dst, ...)
                                                                move its ops: pull (NIXL / in-proc), or
                                                                  receive a push (torch_dist: handoff_push.py)
                                                                partial checksums of pulled blocks
                                                    all ranks vote + sum ─▶ verify ─▶ continue

Block checksums: for block b, `sum over units u of m_u * c(u, b)` (mod a prime),
where a unit is one (global layer, global kv head), `c` a position-weighted sum
of the unit's 16-bit words in that block, and `m_u` a per-unit multiplier (so
swapped heads are caught). The sum makes it independent of how units are split
over ranks, so any TP/PP layout computes the same value, and being per block it
lets a decode side that reused some cached blocks verify exactly what it pulled.
"""

from __future__ import annotations

import enum
import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from splitserve.engine.handoff_checksums import (  # noqa: F401 - re-exported: part of the handoff API
    PRIME,
    pack_checksums,
    partial_block_checksums,
)
from splitserve.engine.transfer.layout import KVLayout
from splitserve.engine.transfer.plan import TransferPlan, build_plan
from splitserve.engine.transfer.transport import KVTransport, TransferError, TransferStats


class HandoffStage(enum.Enum):
    """Where a decode-side import is; a failure names the stage it happened in.

    planning -> transferring -> verifying -> (done | failed). Every wait has a
    deadline (the transport's timeout), so no stage can hang.
    """

    PLANNING = "planning"
    TRANSFERRING = "transferring"
    VERIFYING = "verifying"


class ChecksumMismatchError(TransferError):
    """Pulled KV does not match what the prefill side computed."""


@dataclass(frozen=True)
class RankEndpoint:
    rank: int
    address: str
    agent_metadata: bytes
    state_metadata: bytes = b""
    """Hybrid models: where the rank's recurrent-state tensors are (`state_handoff.expose_state`);
    it travels in the descriptor's `StateHandoff.endpoints`, not with the KV endpoint."""


@dataclass(frozen=True)
class HandoffDescriptor:
    """Everything a decode group needs to pull one request's KV (mirrors the proto)."""

    request_id: str
    model_fingerprint: str
    layout: KVLayout
    rank_block_ids: dict[int, tuple[int, ...]]
    num_tokens: int
    transport_kind: str
    endpoints: dict[int, RankEndpoint]
    first_token_id: int
    lease_deadline_unix_ms: int
    block_checksums: tuple[int, ...]
    first_token_logprob: float | None = None
    first_token_top_logprobs: dict[int, float] = field(default_factory=dict)
    state: Any = None
    """Hybrid models: the request's recurrent state (`state_handoff.StateHandoff`), moved
    and verified with the KV by `make_importer`; None for attention-only models."""
    progress_slot: int | None = None
    """Layer-wise streaming (`TransferConfig.layerwise`): the row of every source rank's progress
    board that tracks this request (transfer/progress.py); None: pull everything at once."""

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"handoff of {self.num_tokens!r} tokens")
        if sorted(self.rank_block_ids) != list(range(self.layout.world_size)):
            raise ValueError(f"block ids for ranks {sorted(self.rank_block_ids)}, layout has {self.layout.world_size}")
        num_blocks = -(-self.num_tokens // self.layout.block_size)
        if any(len(ids) != num_blocks for ids in self.rank_block_ids.values()):
            raise ValueError(f"{self.num_tokens} tokens need {num_blocks} blocks per rank")
        if self.block_checksums and len(self.block_checksums) != num_blocks:
            raise ValueError(f"{len(self.block_checksums)} block checksums for {num_blocks} blocks")
        if self.progress_slot is not None and self.progress_slot < 0:
            raise ValueError(f"progress_slot must be >= 0 or None, got {self.progress_slot!r}")
        if self.is_preview and self.progress_slot is None:
            raise ValueError("a handoff without block checksums (a preview) must name a progress slot")

    @property
    def is_preview(self) -> bool:
        """A preview (`PrefillEvent.handoff_started`): where the KV will be, published before the
        prefill's forward pass, so no first token and no block checksums yet. Good for a prefetch
        (engine/prefetch.py), never for an import."""
        return not self.block_checksums


def engine_layout(engine) -> KVLayout:
    """The KV layout of an engine (identical on all its ranks)."""
    cfg, ps = engine.model_config, engine.ps
    from splitserve.engine.parallel import stage_layer_range

    stages = tuple(stage_layer_range(cfg.num_layers, ps.pp_size, s) for s in range(ps.pp_size))
    if getattr(cfg, "is_hybrid", False):  # only attention layers have KV: ranges over those
        stages = tuple(cfg.kv_layer_range(start, end) for start, end in stages)
    return KVLayout(
        dtype=str(engine.runner.dtype).removeprefix("torch."),
        block_size=engine.block_size,
        tp=ps.tp_size,
        pp=ps.pp_size,
        num_layers=stages[-1][1],
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        layer_ranges=stages,
    )


def engine_fingerprint(engine) -> str:
    """The model identity a handoff carries: `model_fingerprint` of the engine's
    checkpoint, or a simulated engine's own (`--engine sim`, never a real one's)."""
    if getattr(engine, "is_simulated", False):
        return engine.fingerprint
    # Once per engine: it names the model as loaded, and hashing config.json on every publish and
    # import cost ~0.2 ms of the host each on the H200 (benchmarks/RESULTS.md, 2026-12-02).
    cached = getattr(engine, "_model_fingerprint", None)
    if cached is None:
        cached = model_fingerprint(engine.model_path)
        engine._model_fingerprint = cached
    return cached


def model_fingerprint(model_dir: str) -> str:
    """Architecture + weights identity: config.json bytes and each weight file's name and size."""
    path = Path(model_dir)
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        digest.update(f"{f.name}:{f.stat().st_size}".encode())
    return digest.hexdigest()[:32]


def group_block_checksums(engine, block_ids: Sequence[int]) -> tuple[int, ...]:
    """Block checksums of the whole group (collective: call on every rank)."""
    partial = partial_block_checksums(engine.kv_caches, engine_layout(engine), engine.ps.rank, block_ids)
    if engine.ps.world_size > 1:
        dist.all_reduce(partial)
    return pack_checksums(partial)


# ---------------------------------------------------------------- descriptors
def build_descriptor(
    engine,
    handoff,
    endpoints: dict[int, RankEndpoint],
    transport_kind: str,
    checksums: tuple[int, ...],
    top_logprobs: dict[int, float] | None = None,
    progress_slot: int | None = None,
) -> HandoffDescriptor:
    """Descriptor for a pinned handoff of `engine` (rank 0 of the prefill group)."""
    layout = engine_layout(engine)
    remaining_s = max(0.0, handoff.lease_deadline - time.monotonic())
    return HandoffDescriptor(
        request_id=handoff.request_id,
        model_fingerprint=engine_fingerprint(engine),
        layout=layout,
        rank_block_ids={r: tuple(handoff.block_ids) for r in range(layout.world_size)},
        num_tokens=handoff.num_tokens,
        transport_kind=transport_kind,
        endpoints=endpoints,
        first_token_id=handoff.first_token_id,
        lease_deadline_unix_ms=int((time.time() + remaining_s) * 1000),
        block_checksums=checksums,
        first_token_logprob=handoff.first_token_logprob,
        first_token_top_logprobs=dict(top_logprobs or {}),
        progress_slot=progress_slot,
    )


def build_preview(
    engine, request_id: str, slot: int, block_ids: Sequence[int], num_tokens: int,
    endpoints: dict[int, RankEndpoint], transport_kind: str,
) -> HandoffDescriptor:  # fmt: skip
    """The preview of a streamed handoff whose forward pass is starting (rank 0 of the prefill
    group): no first token, no checksums; leased as long as a pin will be."""
    layout = engine_layout(engine)
    return HandoffDescriptor(
        request_id=request_id,
        model_fingerprint=engine_fingerprint(engine),
        layout=layout,
        rank_block_ids={r: tuple(block_ids) for r in range(layout.world_size)},
        num_tokens=num_tokens,
        transport_kind=transport_kind,
        endpoints=endpoints,
        first_token_id=0,
        lease_deadline_unix_ms=int((time.time() + engine.config.cache.handoff_lease_s) * 1000),
        block_checksums=(),
        progress_slot=slot,
    )


TransferStep = Callable[[TransferPlan, list[int]], TransferStats]
"""`step(plan, dst_block_ids)`: move this rank's ops of `plan` into the decode engine's KV
(`dst_block_ids`: the request's block table, the same on every rank). Called on every rank
of the decode group whenever the plan moves anything — ranks without ops of their own too,
since a two-sided transport (torch_dist) needs all of them. Raises TransferError."""


def pull_step(engine, transport: KVTransport, desc: HandoffDescriptor, timeout_s: float = 30.0) -> TransferStep:
    """The transfer step of a pull transport (NIXL, shm, in-process): read this rank's ops from the
    sources — layer by layer (transfer/streaming.py) when the descriptor names a progress slot and
    this engine has `transfer.layerwise` on."""
    remote = {r: e.agent_metadata for r, e in desc.endpoints.items()}

    is_streamed = desc.progress_slot is not None and engine.config.transfer.layerwise

    def step(plan: TransferPlan, dst_block_ids: list[int]) -> TransferStats:
        if not plan.ops_for_dst(engine.ps.rank):
            return TransferStats(0, 0.0, 0)
        if is_streamed:  # layer by layer as the boards show them; the block checksums verify it after
            from splitserve.engine.transfer.progress import request_tag
            from splitserve.engine.transfer.streaming import StreamSpec, streamed_pull

            spec = StreamSpec(desc.progress_slot, request_tag(desc.request_id), desc.num_tokens)
            return streamed_pull(transport, plan, engine.ps.rank, remote, engine.kv_caches, spec, timeout_s,
                                 verify=False)  # fmt: skip
        return transport.pull(plan, engine.ps.rank, remote, engine.kv_caches, timeout_s)

    return step


def make_importer(
    engine,
    transport: KVTransport | None,
    desc: HandoffDescriptor,
    timeout_s: float = 30.0,
    stats_out: list | None = None,
    transfer: TransferStep | None = None,
    state_step: Callable | None = None,
    request_id: str | None = None,
    checked: Callable[[], torch.Tensor | None] | None = None,
) -> Callable[[list[int], int], None]:
    """The `import_kv(block_ids, first_block)` callback for `Engine.add_imported_request`.

    Runs on every rank of the decode group (a collective): each rank moves its
    own ops with `transfer` (default: `pull_step` of `transport`), then all ranks
    vote and verify the block checksums, so either every rank keeps the request
    or every rank rolls it back. `checked()`, when given, returns this rank's share of
    the pulled blocks' checksums if it was computed as they arrived (else None: computed here).
    """
    if getattr(engine, "is_simulated", False):  # --engine sim: no KV to move, only its time to model
        from splitserve.engine.sim_engine import make_sim_importer

        return make_sim_importer(engine, desc, timeout_s, stats_out)
    step = transfer if transfer is not None else pull_step(engine, transport, desc, timeout_s)
    # Hybrid models: the recurrent state moves and is verified with the KV (state_handoff.py);
    # `state_step` moves it (default: pulled over `transport`), into the slot of `request_id`.
    has_state = getattr(engine.runner, "states", None) is not None
    if has_state:
        import dataclasses

        from splitserve.engine.state_handoff import import_state, pull_state_step, verify_state

        state_desc = desc if request_id in (None, desc.request_id) else dataclasses.replace(desc, request_id=request_id)
        move_state = state_step if state_step is not None else pull_state_step(engine, transport, desc, timeout_s)

    if desc.is_preview:
        raise ValueError(f"handoff {desc.request_id} is a preview (no block checksums): prefetch it, do not import it")

    def import_kv(block_ids: list[int], first_block: int) -> None:
        dst = engine_layout(engine)
        if desc.model_fingerprint != engine_fingerprint(engine):
            raise TransferError("handoff comes from a different model (fingerprint mismatch)")
        n = len(desc.rank_block_ids[0])
        stage = HandoffStage.PLANNING
        error: Exception | None = None
        partial = torch.zeros(max(0, n - first_block), 2, dtype=torch.int64, device=engine.kv_caches[0].device)
        stats = TransferStats(0, 0.0, 0)
        try:
            plan = build_plan(desc.layout, dst, desc.rank_block_ids, {r: block_ids for r in range(dst.world_size)}, first_block)
            stage = HandoffStage.TRANSFERRING
            if plan.ops:  # the same on every rank: all of them call the step, or none
                stats = step(plan, list(block_ids))
            if has_state:
                state_partial = import_state(engine, state_desc, move_state)
            stage = HandoffStage.VERIFYING
            early = checked() if checked is not None else None  # summed as the layers arrived (a prefetch)
            partial = early if early is not None else partial_block_checksums(
                engine.kv_caches, dst, engine.ps.rank, block_ids[first_block:n])
        except Exception as exc:  # vote below; every rank must reach the collectives
            error = exc
        if not engine.ps.all_true(error is None):
            if error is None:
                raise TransferError(f"handoff {desc.request_id}: a peer rank failed its part of the pull")
            kind = type(error) if isinstance(error, TransferError) else TransferError
            raise kind(f"handoff {desc.request_id}: {stage.value} failed: {error}") from error
        if has_state:
            verify_state(engine, desc, state_partial)
        if engine.ps.world_size > 1:
            dist.all_reduce(partial)
        got = pack_checksums(partial)
        want = desc.block_checksums[first_block:]
        if got != want:
            bad = [first_block + i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
            raise ChecksumMismatchError(
                f"handoff {desc.request_id}: verifying failed: pulled blocks {bad[:8]} do not match their checksums"
            )
        if stats_out is not None:
            stats_out.append(stats)

    return import_kv
