"""Decode side of served layer-wise streaming: pull a handoff while prefill still computes it.

    router: PrefillEvent.handoff_started (a preview) ─▶ DecodeWorker.Prefetch ─▶ "prefetch", every rank:
        reserve the blocks (prefix-cache hits + fresh ones: Engine.reserve_import_blocks)
        plan = build_plan(preview's layout → ours)
        a thread: streamed_pull of this rank's ops, each layer as the prefill ranks' boards
        show it written (engine/handoff_layerwise.py marks them during the forward pass)
    router: Decode(full descriptor) ─▶ "import", every rank:
        `take`: the same request, layout, endpoints and source blocks as the preview?
          yes → import into the reserved blocks; the transfer step waits for the thread (the
                last layers), and if the prefetch failed pulls the plan again from the pinned copy
          no  → drop the prefetch, import as usual
        either way the block checksums are verified as for any import; the prefetch thread has
        already summed this rank's share layer by layer as they arrived, so only the comparison
        is left (unless the plan was pulled again)
    Abort, or a lease's time (the preview's lease length) passing without a new layer — the prefill
    may compute for longer than a lease, as long as it makes progress — (rank 0's clock, sent as a
    "drop_prefetch" command): cancel the thread, wait for it, give the blocks back. Nothing stays
    reserved.

Pulls run on a background thread per rank, off the engine thread, so the decode steps of other
requests go on while a prefill is still computing. A pull transport serves one caller at a time
(staging buffers, connection caches), so every pull of the rank — prefetch threads and the
engine thread's imports — goes through one lock (`SerializedTransport`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from splitserve.engine.handoff import HandoffDescriptor, TransferStep, engine_fingerprint, engine_layout
from splitserve.engine.handoff_checksums import PRIME, partial_block_checksums
from splitserve.engine.transfer.plan import TransferPlan, build_plan
from splitserve.engine.transfer.progress import request_tag
from splitserve.engine.transfer.streaming import StreamSpec, streamed_pull
from splitserve.engine.transfer.transport import KVTransport, TransferError, TransferStats, TransferTimeout

log = logging.getLogger(__name__)

PREFETCH_POLL_S = 0.0005
PREFETCH_MAX_POLL_S = 0.02
"""Board polling of a prefetch: from PREFETCH_POLL_S, doubling while nothing new is ready, up to
PREFETCH_MAX_POLL_S. It may wait through a whole prefill, and a thread waking every few hundred
microseconds takes a core from a prefill that shares the host (measured on a 2-core machine: the
prefill's OpenMP regions stall on the preempted thread, first token +30%). The last layer is at
most ~20 ms late, while the prefill still samples, checksums and publishes."""
PREFETCH_MAX_S = 3600.0
"""A prefetch's thread gives up after this long in all, progress or not (a bound, not a lease)."""
JOIN_TIMEOUT_S = 10.0
"""How long dropping a prefetch waits for its thread (cancelled between pulls) to stop."""


class SerializedTransport:
    """A pull transport whose pulls and board reads take one lock: safe from several threads."""

    def __init__(self, transport: KVTransport, lock: threading.Lock | None = None):
        self.transport = transport
        self.lock = lock or threading.Lock()

    def pull(self, *args, **kwargs) -> TransferStats:
        with self.lock:
            return self.transport.pull(*args, **kwargs)

    def read_board(self, *args, **kwargs) -> list[int]:
        with self.lock:
            return self.transport.read_board(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.transport, name)


@dataclass
class Prefetch:
    """One request's prefetch on this rank."""

    preview: HandoffDescriptor
    plan: TransferPlan
    lease_s: float
    """The preview's lease length: the prefetch expires this long after its last progress."""
    last_progress: float = field(default_factory=time.monotonic)
    """`time.monotonic()` of its start or last layer pulled (rank 0's decides expiry)."""
    block_ids: list[int] = field(default_factory=list)
    """The request's block table here (prefix-cache hits, then the reserved blocks)."""
    first_block: int = 0
    cancel: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    outcome: TransferStats | BaseException | None = None
    partial: torch.Tensor | None = None
    """This rank's share of the pulled blocks' checksums, summed layer by layer in the thread (CPU
    caches; a GPU's kernel does all layers at once at import)."""
    checked_layers: set[int] = field(default_factory=set)
    num_layers: int = 0
    """Local layers of this rank's KV (all must be summed for `checked` to answer)."""

    def checked(self) -> torch.Tensor | None:
        """The share, if every local layer was summed and nothing was pulled again since."""
        return self.partial if self.partial is not None and len(self.checked_layers) == self.num_layers else None

    def wait(self, timeout_s: float) -> TransferStats:
        """The pull's stats once every layer is in. Raises TransferError (timeout or failure)."""
        if self.thread is not None:
            self.thread.join(max(0.0, timeout_s))
            if self.thread.is_alive():
                raise TransferTimeout(f"prefetch of {self.preview.request_id} still pulling after {timeout_s:.1f}s")
        if isinstance(self.outcome, BaseException):
            raise TransferError(f"prefetch failed: {self.outcome}") from self.outcome
        return self.outcome


def same_source(preview: HandoffDescriptor, desc: HandoffDescriptor) -> bool:
    """Does the full descriptor name the KV the preview did (so the prefetched blocks hold it)?"""
    return (
        preview.request_id == desc.request_id and preview.model_fingerprint == desc.model_fingerprint
        and preview.layout == desc.layout and preview.rank_block_ids == desc.rank_block_ids
        and preview.num_tokens == desc.num_tokens and preview.transport_kind == desc.transport_kind
        and {r: e.agent_metadata for r, e in preview.endpoints.items()}
        == {r: e.agent_metadata for r, e in desc.endpoints.items()}
    )  # fmt: skip


class Prefetches:
    """This rank's prefetches, by request id. Owned by the engine thread (threads only pull)."""

    def __init__(self, engine, transport: SerializedTransport):
        self.engine = engine
        self.transport = transport
        self._entries: dict[str, Prefetch] = {}
        self._stragglers: list[tuple[str, Prefetch]] = []
        """Dropped prefetches whose thread did not stop in time: their blocks stay reserved
        (under a tombstone key) until it does (`collect`)."""

    def start(self, request_id: str, token_ids: Sequence[int], preview: HandoffDescriptor) -> None:
        """Reserve the request's blocks and start pulling (every rank). Raises NoFreeBlocksError,
        ValueError (a bad preview) or TransferError; nothing stays reserved then."""
        if not preview.is_preview or preview.request_id != request_id:
            raise ValueError(f"prefetch of {request_id!r} needs its handoff_started preview")
        self.drop(request_id)  # an earlier attempt's (another prefill worker, another slot)
        engine = self.engine
        block_ids, hits = engine.reserve_import_blocks(request_id, list(token_ids))
        try:
            if preview.model_fingerprint != engine_fingerprint(engine):
                raise TransferError("handoff comes from a different model (fingerprint mismatch)")
            dst = engine_layout(engine)
            plan = build_plan(preview.layout, dst, preview.rank_block_ids,
                              {r: block_ids for r in range(dst.world_size)}, hits)  # fmt: skip
        except BaseException:
            engine.unreserve(request_id)
            raise
        left_s = max(0.0, preview.lease_deadline_unix_ms / 1000 - time.time())
        entry = Prefetch(preview, plan, left_s, block_ids=block_ids, first_block=hits, num_layers=len(engine.kv_caches))
        self._entries[request_id] = entry
        if not plan.ops_for_dst(engine.ps.rank):
            entry.outcome = TransferStats(0, 0.0, 0)
            return
        entry.thread = threading.Thread(target=self._pull, args=(entry, left_s), name=f"prefetch-{request_id}",
                                        daemon=True)  # fmt: skip
        entry.thread.start()

    def _pull(self, entry: Prefetch, timeout_s: float) -> None:
        desc = entry.preview
        spec = StreamSpec(desc.progress_slot, request_tag(desc.request_id), desc.num_tokens)
        remote = {r: e.agent_metadata for r, e in desc.endpoints.items()}
        engine = self.engine
        kv, layout, rank = engine.kv_caches, engine_layout(engine), engine.ps.rank
        pulled_blocks = entry.block_ids[entry.first_block:]
        is_cpu = kv[0].device.type == "cpu"
        if is_cpu:
            entry.partial = torch.zeros(len(pulled_blocks), 2, dtype=torch.int64)

        def arrived(layers: list[int]) -> None:  # while later layers are still being computed
            entry.last_progress = time.monotonic()
            if is_cpu:
                entry.partial += partial_block_checksums(kv, layout, rank, pulled_blocks, layers)
                entry.partial %= PRIME
                entry.checked_layers.update(layers)

        try:
            with torch.inference_mode():
                entry.outcome = streamed_pull(
                    self.transport, entry.plan, rank, remote, kv, spec, timeout_s=PREFETCH_MAX_S,
                    poll_s=PREFETCH_POLL_S, max_poll_s=PREFETCH_MAX_POLL_S, verify=False, cancel=entry.cancel,
                    on_layers=arrived, stall_timeout_s=timeout_s,
                )  # fmt: skip
        except BaseException as exc:  # read by `Prefetch.wait` on the engine thread
            entry.outcome = exc

    def take(self, request_id: str, desc: HandoffDescriptor) -> Prefetch | None:
        """The request's prefetch if it pulls what `desc` describes (its blocks stay reserved, for
        `Engine.add_imported_request(reserved=True)`); a mismatching one is dropped. Every rank
        decides alike (same commands, same descriptor)."""
        entry = self._entries.get(request_id)
        if entry is None:
            return None
        if not same_source(entry.preview, desc):
            log.info("prefetch of %s does not match its handoff; pulling it afresh", request_id)
            self.drop(request_id)
            return None
        return self._entries.pop(request_id)

    def drop(self, request_id: str) -> bool:
        """Cancel the request's prefetch and give its blocks back (a no-op without one)."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return False
        self.discard(request_id, entry)
        return True

    def discard(self, request_id: str, entry: Prefetch) -> None:
        """Stop a prefetch no longer in the table (taken, then not imported) and free its blocks."""
        entry.cancel.set()
        if entry.thread is not None:
            entry.thread.join(JOIN_TIMEOUT_S)
            if entry.thread.is_alive():  # still inside one pull: its blocks stay held until it returns
                self._straggle(request_id, entry, self.engine.reserved.pop(request_id))
                return
        self.engine.unreserve(request_id)

    def _straggle(self, request_id: str, entry: Prefetch, held: tuple[list[int], int]) -> None:
        """A thread that did not stop may still write `held`'s blocks: they stay reserved (counted by
        the integrity check, under a tombstone key) until `collect` sees it stop."""
        log.error("prefetch of %s did not stop within %.0fs; its blocks stay reserved until it does",
                  request_id, JOIN_TIMEOUT_S)  # fmt: skip
        tombstone = f"{request_id}\x00dropped@{time.monotonic()}"
        self.engine.reserved[tombstone] = held
        self._stragglers.append((tombstone, entry))

    def collect(self) -> None:
        """Free the blocks of dropped prefetches whose thread has stopped since."""
        still = []
        for tombstone, entry in self._stragglers:
            if entry.thread.is_alive():
                still.append((tombstone, entry))
            else:
                self.engine.unreserve(tombstone)
        self._stragglers = still

    def expired(self, now: float | None = None) -> list[str]:
        """Request ids without progress for a lease's time (rank 0 decides; see the module doc)."""
        now = time.monotonic() if now is None else now
        return [rid for rid, entry in self._entries.items() if entry.last_progress + entry.lease_s <= now]

    def transfer_step(self, entry: Prefetch, fallback: TransferStep, timeout_s: float) -> TransferStep:
        """The import's transfer step for a taken prefetch: wait for its thread; pull afresh from
        the pinned copy (`fallback`) if it failed. Returns the prefetch's own stats."""

        def step(plan: TransferPlan, dst_block_ids: list[int]) -> TransferStats:
            try:
                return entry.wait(timeout_s)
            except TransferError as exc:
                entry.cancel.set()
                if entry.thread is not None:
                    entry.thread.join(JOIN_TIMEOUT_S)
                    if entry.thread.is_alive():  # cannot write the blocks under a pull still running;
                        # the failed import frees them, so the thread's own reference keeps them
                        pulled = entry.block_ids[entry.first_block:]
                        self.engine.pool.ref(pulled)
                        self._straggle(entry.preview.request_id, entry, (pulled, 0))
                        raise
                log.warning("prefetch of %s failed (%s); pulling it again", entry.preview.request_id, exc)
                entry.partial = None  # the share summed so far is not of what is pulled now
                return fallback(plan, dst_block_ids)

        return step
