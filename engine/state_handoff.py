"""The recurrent state in a handoff (hybrid models): what a prefill group adds to the
descriptor, and the decode side's import step, run inside `handoff.make_importer`.

    prefill: request pinned (its state slot too) -> every rank: partial state checksum
             -sum-> StateHandoff(layout, slot, checksum, per-rank state endpoints) in the descriptor
    decode:  every rank: a slot for the request -> state plan (state_plan.py) -> move its ops
             (in-process / NIXL pull, or a torch_dist push) -> partial checksum -> vote + verify

Checksum: the sum over units u of m_u · c(u) (mod 2^31 - 1), a unit being one (global mamba
layer, global conv channel) row of the conv state or one (layer, head) [P, N] tile of the SSM
state, so it is the same on any TP/PP layout (like the KV block checksums in handoff.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from splitserve.engine.parallel import stage_layer_range
from splitserve.engine.transfer.state_plan import StateLayout, StateOp, build_state_plan, state_regions
from splitserve.engine.transfer.state_transport import pull_inproc, pull_nixl
from splitserve.engine.transfer.transport import TransferError, TransferStats

PRIME = (1 << 31) - 1


@dataclass(frozen=True)
class StateHandoff:
    """The recurrent state of one handoff (an optional part of `HandoffDescriptor`)."""

    layout: StateLayout
    slot: int
    """The request's state slot, the same on every source rank (SPMD)."""
    checksum: int
    endpoints: Mapping[int, bytes] = field(default_factory=dict)
    """Per source rank: where its state tensors are, for pull transports (NIXL / in-process)."""


def has_recurrent_state(engine) -> bool:
    """A hybrid model's engine (a recurrent-state pool beside the KV)."""
    return getattr(getattr(engine, "runner", None), "states", None) is not None


def missing_state(engine, desc) -> str | None:
    """Why `desc` cannot be imported by this decode engine as is (a hybrid model's handoff
    without the recurrent state: the KV alone cannot continue it), or None."""
    if has_recurrent_state(engine) and getattr(desc, "state", None) is None:
        return "the handoff carries no recurrent (Mamba) state and this model is hybrid"
    return None


def expose_state(engine, transport) -> bytes:
    """Worker start, every rank: expose this rank's state tensors to a pull transport (NIXL:
    register them BEFORE the KV `expose`, so the agent metadata it returns covers them).
    Returns the rank's state endpoint for `StateHandoff.endpoints`; b"" when the model has no
    recurrent state or the transport pushes it (torch_dist: handoff_push_state.py)."""
    if not has_recurrent_state(engine) or transport.kind != "nixl":
        return b""
    from splitserve.engine.transfer.state_transport import register_nixl

    return register_nixl(transport, state_tensors(engine))


def engine_state_layout(engine) -> StateLayout:
    cfg, ps, states = engine.model_config, engine.ps, engine.runner.states
    mamba = set(cfg.mamba_layer_ids())

    def count_before(layer: int) -> int:
        return sum(1 for i in mamba if i < layer)

    ranges = tuple(
        (count_before(s), count_before(e))
        for s, e in (stage_layer_range(cfg.num_layers, ps.pp_size, p) for p in range(ps.pp_size))
    )
    return StateLayout(
        tp=ps.tp_size, pp=ps.pp_size, num_layers=len(mamba), layer_ranges=ranges,
        num_heads=cfg.mamba_num_heads, head_dim=cfg.mamba_head_dim, num_groups=cfg.mamba_num_groups,
        state_size=cfg.ssm_state_size, conv_width=cfg.conv_kernel - 1,
        conv_dtype=str(states.pool.conv_dtype).removeprefix("torch."),
        ssm_dtype=str(states.pool.ssm_dtype).removeprefix("torch."),
    )


def state_tensors(engine) -> list[torch.Tensor]:
    """This rank's state tensors as the flat list the state regions address."""
    return [t for layer in engine.runner.states.layers for t in (layer.conv, layer.ssm)]


def _fletcher_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    words = rows.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF  # [units, W]
    weights = torch.arange(1, words.shape[1] + 1, dtype=torch.int64, device=rows.device)
    return words.sum(1) % PRIME, ((words * weights) % PRIME).sum(1) % PRIME


def partial_state_checksum(tensors: list[torch.Tensor], layout: StateLayout, rank: int, slot: int) -> torch.Tensor:
    """This rank's share: int64 [2] (s1, s2), each < PRIME."""
    tp_rank, pp_rank = rank % layout.tp, rank // layout.tp
    device = tensors[0].device if tensors else torch.device("cpu")
    total = torch.zeros(2, dtype=torch.int64, device=device)
    stride = layout.conv_dim + layout.num_heads
    channels = torch.as_tensor(layout.local_conv_channels(tp_rank), device=device)
    heads = torch.arange(tp_rank * layout.heads_per_rank, (tp_rank + 1) * layout.heads_per_rank, device=device)
    layer0 = layout.layer_ranges[pp_rank][0]
    for i in range(len(tensors) // 2):
        base = (layer0 + i) * stride + 1
        for rows, mult in ((tensors[2 * i][slot], base + channels),
                           (tensors[2 * i + 1][slot].flatten(1), base + layout.conv_dim + heads)):
            s1, s2 = _fletcher_rows(rows)
            total[0] += (s1 * mult % PRIME).sum()
            total[1] += (s2 * mult % PRIME).sum()
            total %= PRIME
    return total


def _pack(sums: torch.Tensor) -> int:
    a, b = (sums % PRIME).tolist()
    return (a << 32) | b


def group_state_checksum(engine, slot: int) -> int:
    """The state checksum of the whole group (collective: call on every rank)."""
    partial = partial_state_checksum(state_tensors(engine), engine_state_layout(engine), engine.ps.rank, slot)
    if engine.ps.world_size > 1:
        dist.all_reduce(partial)
    return _pack(partial)


def build_state_handoff(engine, request_id: str, endpoints: Mapping[int, bytes] | None = None) -> StateHandoff:
    """For a pinned prefill request (collective: every rank computes the checksum)."""
    slot = engine.runner.states.pool.slot_of(request_id)
    if slot is None or request_id not in engine.runner.states.pool.pinned:
        raise ValueError(f"request {request_id!r} has no pinned recurrent state")
    return StateHandoff(engine_state_layout(engine), slot, group_state_checksum(engine, slot), dict(endpoints or {}))


StateStep = Callable[[StateHandoff, tuple[StateOp, ...], int], TransferStats]
"""`step(handoff, plan_ops, dst_slot)`: move this rank's ops of the state plan into slot `dst_slot`
of the decode engine; called on every decode rank (two-sided transports need all of them)."""


def pull_state_step(engine, transport, desc, timeout_s: float = 30.0) -> StateStep:
    """The state step of a pull transport (`inproc` or `nixl`), reading from `handoff.endpoints`."""

    def step(handoff: StateHandoff, ops: tuple[StateOp, ...], dst_slot: int) -> TransferStats:
        rank, dst = engine.ps.rank, engine_state_layout(engine)
        mine = [op for op in ops if op.dst_rank == rank]
        by_src: dict[int, list[StateOp]] = {}
        for op in mine:
            by_src.setdefault(op.src_rank, []).append(op)
        regions = {s: state_regions(o, handoff.layout, dst, handoff.slot, dst_slot) for s, o in by_src.items()}
        missing = sorted(s for s in regions if s not in handoff.endpoints)
        if missing:
            raise TransferError(f"handoff has no state endpoint for source ranks {missing}")
        tensors = state_tensors(engine)
        if transport.kind == "nixl":
            sources = {s: (desc.endpoints[s].agent_metadata, handoff.endpoints[s], r) for s, r in regions.items()}
            return pull_nixl(transport, sources, tensors, timeout_s)
        if transport.kind == "inproc":
            return pull_inproc({s: (handoff.endpoints[s], r) for s, r in regions.items()}, tensors)
        raise TransferError(f"the {transport.kind} transport cannot pull recurrent state; pass a state step")

    return step


def import_state(engine, desc, step: StateStep) -> torch.Tensor:
    """Decode side, every rank: take a slot for the request, move the state into it, and
    return this rank's partial checksum (the caller votes and verifies)."""
    handoff: StateHandoff | None = getattr(desc, "state", None)
    if handoff is None:
        raise TransferError("this hybrid model's handoff carries no recurrent state")
    dst = engine_state_layout(engine)
    ops = build_state_plan(handoff.layout, dst)
    slot = engine.runner.states.import_slot(desc.request_id, desc.num_tokens)
    step(handoff, ops, slot)
    return partial_state_checksum(state_tensors(engine), dst, engine.ps.rank, slot)


def verify_state(engine, desc, partial: torch.Tensor) -> None:
    """After the vote (collective): sum the partials and compare with the descriptor's."""
    if engine.ps.world_size > 1:
        dist.all_reduce(partial)
    if _pack(partial) != desc.state.checksum:
        from splitserve.engine.handoff import ChecksumMismatchError

        raise ChecksumMismatchError(f"handoff {desc.request_id}: verifying failed: the recurrent state does not match")
