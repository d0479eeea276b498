"""The `torch_dist` handoff (NCCL on GPU, gloo on CPU): the decode side asks, the prefill side
pushes, over a process group cached per (prefill worker, decode worker) pair.

P2P needs both ends inside a call at the same time, and both worker groups apply engine
commands in step (`EngineLoop`), so a transfer is one command on each side::

    decode group: "import" command                     prefill group: idle / stepping
      every rank: plan = build_plan(...)
      rank 0: ask(PushRequest) ───── PushKV RPC ─────▶ rank 0 (gRPC thread): submit "push",
                                                         wait only for the grant
                                                        "push" command, every rank:
                                                          rank 0 decides (pinned? plan? group?)
                                                          broadcast decision
              ◀──────────── PushGrant ─────────────────  rank 0 resolves the RPC  (before blocking)
      broadcast grant to every rank
      every rank: join / reuse the pair group ◀──────▶  every rank: join / reuse the pair group
      every rank: recv_plan ◀───────── packed buffers ── every rank: send_plan
      vote + block checksums (handoff.make_importer)     vote; a failed send drops the group

Neither side waits for anything that needs its own loop: the PushKV RPC is served by the
prefill's gRPC thread and returns as soon as the "push" command has decided, before its
ranks block in the rendezvous / sends. Every wait has a deadline (`PushRequest.timeout_s`).

The group to use is named by a key the prefill side picks: it reuses its cached group with
the decode worker when the decode side reports the same key, and otherwise creates a new one
(new key, fresh store file). Any failed transfer drops the group on the side that saw it, so
the next push starts from a new rendezvous rather than a stream that may be out of step.
Same host only: the rendezvous is a `FileStore` in a directory of the prefill worker. On GPUs
(NCCL) no prefill rank may share a GPU with a decode rank — NCCL refuses such a group — so the
decode side checks the GPU UUIDs in the endpoints and refuses before asking (use nixl or
cuda_ipc for workers sharing GPUs).

Hybrid models: the recurrent state follows the KV as a second push over the same group
(`PushRequest.state`; engine/handoff_push_state.py). The messages live in handoff_push_messages.py.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable

import torch

from splitserve.engine.handoff import HandoffDescriptor, TransferStep, engine_layout
from splitserve.engine.handoff_push_messages import (  # noqa: F401 - re-exported: the push API
    PushGrant,
    PushRefusedError,
    PushRequest,
    StatePush,
    TorchDistEndpoint,
    _gpu_uuid,
    shared_gpus,
)
from splitserve.engine.transfer.pair_group import PairGroups, PairGroupSpec, backend_for
from splitserve.engine.transfer.plan import TransferPlan, build_plan
from splitserve.engine.transfer.torch_dist import recv_plan, send_plan
from splitserve.engine.transfer.transport import TransferError, TransferStats, TransportEndpoint


class TorchDistTransport(TransportEndpoint):
    """One worker rank's end of the torch_dist handoff: its pair groups, and (rank 0 of a
    prefill worker) the rendezvous directory. Used from the engine loop only."""

    kind = "torch_dist"

    def __init__(self, max_groups: int = 8):
        self.worker_id = uuid.uuid4().hex
        self.groups = PairGroups(max_groups)
        self.device: torch.device | None = None
        self.group_endpoints: list[TorchDistEndpoint] = []
        """Rank 0: every rank's endpoint of this worker (set by the hooks; to spot shared GPUs)."""
        self._rendezvous_dir: str | None = None

    # ------------------------------------------------------------ endpoint
    def expose(self, kv_tensors) -> bytes:
        if not kv_tensors:
            raise ValueError("expose needs the KV tensors")
        self.device = kv_tensors[0].device
        return TorchDistEndpoint(self.worker_id, self.backend, _gpu_uuid(self.device)).to_bytes()

    @property
    def backend(self) -> str:
        return backend_for(self.device or torch.device("cpu"))

    def unexpose(self) -> None:
        """Lifecycle suspend: drop the groups too (NCCL communicators hold GPU memory)."""
        self.groups.close()

    def close(self) -> None:
        self.groups.close()
        if self._rendezvous_dir is not None:
            shutil.rmtree(self._rendezvous_dir, ignore_errors=True)
            self._rendezvous_dir = None

    def _store_path(self, key: str) -> str:
        if self._rendezvous_dir is None:
            self._rendezvous_dir = tempfile.mkdtemp(prefix="splitserve-pairs-")
        return os.path.join(self._rendezvous_dir, key)

    # --------------------------------------------------------- prefill side
    def grant(self, engine, push: PushRequest) -> PushGrant:
        """Rank 0 of the prefill group: check the push can happen and pick the group.

        Raises ValueError (bad or stale request) or TransferError (incompatible peers).
        """
        if push.backend != self.backend:
            raise TransferError(f"decode KV needs {push.backend} but this prefill worker's KV needs {self.backend}")
        if push.state is None:
            _push_plan(engine, push)
        else:
            from splitserve.engine.handoff_push_state import check_state_push

            check_state_push(engine, push)
        key = self.groups.key_for(push.decode_worker_id)
        if key is not None and key == push.group_key:
            return PushGrant(key, self._store_path(key), is_new_group=False)
        key = uuid.uuid4().hex
        return PushGrant(key, self._store_path(key), is_new_group=True)

    def send(self, engine, push: PushRequest, grant: PushGrant) -> TransferStats:
        """Every prefill rank: join (or reuse) the pair group and send this rank's ops."""
        src_world, dst_world = engine.ps.world_size, push.dst_layout.world_size
        spec = PairGroupSpec(grant.group_key, grant.store_path, engine.ps.rank, src_world + dst_world, self.backend)
        group = self.groups.get(push.decode_worker_id, spec, self.device, push.timeout_s)
        peers = {d: src_world + d for d in range(dst_world)}
        if push.state is not None:
            from splitserve.engine.handoff_push_state import send_state

            return send_state(engine, push, peers, group)
        plan = _push_plan(engine, push)
        return send_plan(plan, engine.ps.rank, engine.kv_caches, peers, group, push.timeout_s)

    # ---------------------------------------------------------- decode side
    def receive_step(
        self,
        engine,
        desc: HandoffDescriptor,
        ask: Callable[[PushRequest], PushGrant] | None,
        timeout_s: float,
    ) -> TransferStep:
        """The importer's transfer step for `desc` (every decode rank; `ask` on rank 0 only:
        it calls the prefill worker's PushKV and returns its grant, or raises)."""
        source = self.source_of(desc)

        def step(plan: TransferPlan, dst_block_ids: list[int]) -> TransferStats:
            start = time.perf_counter()
            group = self.join_for_push(engine, desc, ask, PushRequest(
                request_id=desc.request_id, dst_layout=plan.dst, dst_block_ids=tuple(dst_block_ids),
                first_block=plan.first_block, decode_worker_id=self.worker_id,
                group_key=self.groups.key_for(source.worker_id), backend=self.backend, timeout_s=timeout_s,
            ), timeout_s)
            src_world = plan.src.world_size
            stats = recv_plan(plan, engine.ps.rank, engine.kv_caches, {s: s for s in range(src_world)}, group, timeout_s)
            return TransferStats(stats.num_bytes, time.perf_counter() - start, stats.num_regions)

        return step

    def source_of(self, desc: HandoffDescriptor) -> TorchDistEndpoint:
        """The prefill worker of `desc` (its rank 0 endpoint). Raises TransferError."""
        try:
            return TorchDistEndpoint.from_bytes(desc.endpoints[0].agent_metadata)
        except (KeyError, ValueError) as exc:
            raise TransferError(f"handoff {desc.request_id}: bad torch_dist endpoint: {exc}") from exc

    def join_for_push(
        self, engine, desc: HandoffDescriptor, ask: Callable[[PushRequest], PushGrant] | None,
        request: PushRequest, timeout_s: float,
    ):
        """Every decode rank (a collective): rank 0 asks for the push (`request`), every rank
        learns the answer and joins (or reuses) the pair group; returns the group. Raises
        PushRefusedError (nothing will be sent) or TransferError."""
        try:
            sources = [TorchDistEndpoint.from_bytes(e.agent_metadata) for _, e in sorted(desc.endpoints.items())]
        except ValueError as exc:
            raise TransferError(f"handoff {desc.request_id}: bad torch_dist endpoint: {exc}") from exc
        source = self.source_of(desc)
        answer: PushGrant | tuple[bool, str] | None = None
        if engine.ps.rank == 0:
            try:
                if source.backend != self.backend:
                    raise PushRefusedError(f"prefill KV needs {source.backend}, ours needs {self.backend}")
                if shared := shared_gpus(sources, self.group_endpoints):
                    raise PushRefusedError(f"prefill and decode ranks share GPU {sorted(shared)}; NCCL cannot "
                                           "join them: give the workers different GPUs, or use nixl / cuda_ipc")
                if ask is None:
                    raise PushRefusedError("no way to reach the prefill worker")
                answer = ask(request)
            except Exception as exc:  # every rank must learn it: they wait in the broadcast
                answer = (isinstance(exc, PushRefusedError), f"{type(exc).__name__}: {exc}")
        answer = engine.ps.broadcast_from_first(answer)
        if not isinstance(answer, PushGrant):
            is_refused, reason = answer
            kind = PushRefusedError if is_refused else TransferError
            raise kind(f"asking the prefill worker to push failed: {reason}")
        src_world = desc.layout.world_size
        spec = PairGroupSpec(answer.group_key, answer.store_path, src_world + engine.ps.rank,
                             src_world + engine.ps.world_size, self.backend)
        return self.groups.get(source.worker_id, spec, self.device, timeout_s)

    def forget_source(self, desc: HandoffDescriptor) -> None:
        """Decode side, every rank, after a failed import: drop the group with desc's prefill worker."""
        try:
            self.groups.drop(TorchDistEndpoint.from_bytes(desc.endpoints[0].agent_metadata).worker_id)
        except (KeyError, ValueError):
            pass


def _push_plan(engine, push: PushRequest) -> TransferPlan:
    handoff = engine.handoffs.get(push.request_id)
    if handoff is None:
        raise ValueError(f"request {push.request_id!r} has no pinned handoff (released, expired or never prefilled)")
    src = engine_layout(engine)
    return build_plan(
        src,
        push.dst_layout,
        {r: handoff.block_ids for r in range(src.world_size)},
        {r: push.dst_block_ids for r in range(push.dst_layout.world_size)},
        push.first_block,
    )


def serve_push(
    engine, transport: TorchDistTransport, push: PushRequest, waiter: concurrent.futures.Future | None
) -> TransferStats:
    """The prefill "push" command, on every prefill rank (a collective).

    Rank 0 decides — grant, or refuse with the reason — and resolves `waiter` (the PushKV
    call waiting for the answer) before any rank blocks on the decode side; a waiter the
    caller already cancelled turns a grant into a refusal, so a push nobody receives is
    never sent. A refused push sends nothing (PushRefusedError); a failed send (on any rank)
    drops the pair group on every rank (TransferError).
    """
    decision: PushGrant | str | None = None
    if engine.ps.rank == 0:
        if waiter is None:
            decision = "the decode side stopped waiting for the push"
        else:
            try:
                decision = transport.grant(engine, push)
            except (ValueError, TransferError) as exc:
                decision = str(exc)
            try:
                waiter.set_result(decision)
            except concurrent.futures.InvalidStateError:
                # Cancelled: the caller gave up and will not join, so nothing may be sent now.
                decision = "the decode side stopped waiting for the push"
    decision = engine.ps.broadcast_from_first(decision)
    if not isinstance(decision, PushGrant):
        raise PushRefusedError(f"push of {push.request_id} refused: {decision}")
    error: Exception | None = None
    stats = TransferStats(0, 0.0, 0)
    try:
        stats = transport.send(engine, push, decision)
    except Exception as exc:  # vote below; every rank must reach it
        error = exc
    if not engine.ps.all_true(error is None):
        transport.groups.drop(push.decode_worker_id)
        if error is None:
            raise TransferError(f"push of {push.request_id}: a peer rank failed its part of the send")
        kind = type(error) if isinstance(error, TransferError) else TransferError
        raise kind(f"push of {push.request_id} failed: {error}") from error
    return stats
