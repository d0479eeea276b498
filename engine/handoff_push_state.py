"""The recurrent state (hybrid models) over the `torch_dist` handoff: a second push per request,
after the KV's, over the same pair group (engine/handoff_push.py)::

    decode group: importer, state step (every rank)      prefill group
      rank 0: ask(PushRequest(state=StatePush(layout, slot))) ──PushKV──▶ "push" command: grant
      every rank: join / reuse the pair group ◀─────────────────────────▶ every rank: join / reuse
      every rank: recv_packed, unpack into `slot` ◀──── packed regions ─── every rank: pack, send_packed

The state plan (transfer/state_plan.py) is computed on both sides from the two state layouts,
so each side knows, per peer, how many bytes cross and where they land.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from splitserve.engine.handoff import HandoffDescriptor, engine_layout
from splitserve.engine.handoff_push import TorchDistTransport
from splitserve.engine.handoff_push_messages import PushGrant, PushRequest, StatePush
from splitserve.engine.state_handoff import StateHandoff, StateStep, engine_state_layout, state_tensors
from splitserve.engine.transfer.state_plan import (
    StateOp,
    build_state_plan,
    check_state_compatible,
    state_regions,
)
from splitserve.engine.transfer.state_transport import pack, recv_packed, send_packed, unpack
from splitserve.engine.transfer.transport import TransferError, TransferStats


def _pinned_slot(engine, request_id: str) -> int:
    pool = engine.runner.states.pool
    slot = pool.slot_of(request_id)
    if request_id not in engine.handoffs or slot is None or request_id not in pool.pinned:
        raise ValueError(f"request {request_id!r} has no pinned recurrent state (released, expired or never prefilled)")
    return slot


def check_state_push(engine, push: PushRequest) -> None:
    """Prefill rank 0, granting: the state is pinned and the layouts fit. Raises ValueError /
    TransferError."""
    if getattr(engine.runner, "states", None) is None:
        raise TransferError("a recurrent-state push, but this prefill worker's model has no recurrent state")
    _pinned_slot(engine, push.request_id)
    try:
        check_state_compatible(engine_state_layout(engine), push.state.dst_layout)
    except ValueError as exc:
        raise TransferError(str(exc)) from exc


def send_state(engine, push: PushRequest, peers: dict[int, int], group) -> TransferStats:
    """Every prefill rank: pack this rank's state regions per decode rank and send them
    (`peers[decode rank]` = its pair-group rank)."""
    start = time.perf_counter()
    src, dst = engine_state_layout(engine), push.state.dst_layout
    slot = _pinned_slot(engine, push.request_id)
    ops = [op for op in build_state_plan(src, dst) if op.src_rank == engine.ps.rank]
    tensors = state_tensors(engine)
    bufs = {}
    for d in sorted({op.dst_rank for op in ops}):
        regions = state_regions([op for op in ops if op.dst_rank == d], src, dst, slot, push.state.dst_slot)
        bufs[peers[d]] = pack(regions, tensors)
    send_packed(bufs, group, push.timeout_s)
    num_bytes = sum(b.numel() for b in bufs.values())
    return TransferStats(num_bytes, time.perf_counter() - start, len(ops))


def state_receive_step(
    engine,
    transport: TorchDistTransport,
    desc: HandoffDescriptor,
    ask: Callable[[PushRequest], PushGrant] | None,
    timeout_s: float,
) -> StateStep:
    """The importer's state step over torch_dist (every decode rank; `ask` on rank 0 only)."""
    source = transport.source_of(desc)

    def step(handoff: StateHandoff, ops: tuple[StateOp, ...], dst_slot: int) -> TransferStats:
        start = time.perf_counter()
        dst = engine_state_layout(engine)
        request = PushRequest(
            request_id=desc.request_id, dst_layout=engine_layout(engine), dst_block_ids=(), first_block=0,
            decode_worker_id=transport.worker_id, group_key=transport.groups.key_for(source.worker_id),
            backend=transport.backend, timeout_s=timeout_s, state=StatePush(dst, dst_slot),
        )
        group = transport.join_for_push(engine, desc, ask, request, timeout_s)
        mine = [op for op in ops if op.dst_rank == engine.ps.rank]
        regions = {s: state_regions([op for op in mine if op.src_rank == s], handoff.layout, dst, handoff.slot, dst_slot)
                   for s in sorted({op.src_rank for op in mine})}
        tensors = state_tensors(engine)
        # Source rank s is rank s of the pair group (prefill ranks come first).
        device = tensors[0].device if tensors else engine.kv_caches[0].device
        bufs = recv_packed({s: r.bytes_total for s, r in regions.items()}, group, device, timeout_s)
        for s, r in regions.items():
            unpack(bufs[s], r, tensors)
        return TransferStats(sum(r.bytes_total for r in regions.values()), time.perf_counter() - start, len(mine))

    return step
