"""`KVEventSubscriber`: keeps the prefix index in step with every worker's KV events.

One ZMQ SUB socket connects to the `kv_events_endpoint` of every routable
worker (wire format: proto/splitserve/v1/kv_events.proto). Per worker:

    syncing --GetBlockSet answered, buffered events applied--> live
    live    --sequence != last + 1 (missed messages)--------> syncing

While syncing, messages are buffered; the GetBlockSet answer replaces the
worker's blocks and says which event it reflects (`event_sequence`), so only
buffered messages after it are applied. A worker starts in syncing (ZMQ
subscriptions miss what was published before they connected), a sequence
at or below the last applied one is a stale duplicate and is skipped, and a
restarted worker (new lease or endpoint) starts a fresh stream. A worker
that leaves the topology is disconnected and its blocks are dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from splitserve.router.messages import (
    AllBlocksCleared,
    BlockSetSnapshot,
    BlocksRemoved,
    BlocksStored,
    KVEvent,
)
from splitserve.router.prefix_index import PrefixIndex
from splitserve.router.service import kv_events_from_bytes
from splitserve.router.workers import WorkerEndpoint

log = logging.getLogger(__name__)

_SEQUENCE = struct.Struct(">Q")
_MAX_RETRY_DELAY_S = 5.0

FetchBlockSet = Callable[[WorkerEndpoint], Awaitable[BlockSetSnapshot]]


@dataclass
class _Stream:
    """Subscriber state of one worker."""

    worker: WorkerEndpoint
    last_sequence: int = 0
    buffer: list[tuple[int, bytes]] | None = field(default_factory=list)
    """Messages received while syncing; None = live."""
    resync: asyncio.Task[None] | None = None
    num_messages: int = 0
    num_gaps: int = 0
    num_resyncs: int = 0
    is_broken: bool = False
    """Its block size differs from the router's: its events are ignored."""


@dataclass(frozen=True)
class StreamStats:
    """Counters of one followed worker."""

    last_sequence: int
    """Last event message reflected in the index."""
    num_messages: int
    """Messages received."""
    num_gaps: int
    """Times a sequence number was skipped."""
    num_resyncs: int
    """GetBlockSet answers applied (the first one included)."""


class KVEventSubscriber:
    """Follows the KV events of a changing set of workers into a PrefixIndex (one event loop)."""

    def __init__(
        self,
        index: PrefixIndex,
        fetch_block_set: FetchBlockSet,
        block_size: int,
        *,
        retry_delay_s: float = 0.2,
        max_buffered: int = 100_000,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        """`fetch_block_set(worker)` calls the worker's GetBlockSet; failures are retried every `retry_delay_s`."""
        self._index = index
        self._fetch = fetch_block_set
        self._block_size = block_size
        self._retry_delay_s = retry_delay_s
        self._max_buffered = max_buffered
        self._socket = (context or zmq.asyncio.Context.instance()).socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)  # never drop on our side; gaps come from the publishers' HWM
        self._socket.subscribe(b"")
        self._streams: dict[str, _Stream] = {}
        self._receiver: asyncio.Task[None] | None = None
        self._synced = asyncio.Condition()

    # ----------------------------------------------------------------- control
    def start(self) -> None:
        self._receiver = asyncio.create_task(self._receive(), name="kv-event-subscriber")

    def set_workers(self, workers: Mapping[str, WorkerEndpoint]) -> None:
        """Follows exactly the workers in `workers` that publish events (a topology change)."""
        wanted = {w.worker_id: w for w in workers.values() if w.kv_events_endpoint is not None}
        for worker_id, stream in list(self._streams.items()):
            worker = wanted.get(worker_id)
            if worker is None or worker.event_stream_key != stream.worker.event_stream_key:
                self._drop(stream)
        for worker_id, worker in wanted.items():
            if worker_id not in self._streams:
                self._socket.connect(worker.kv_events_endpoint)
                stream = self._streams[worker_id] = _Stream(worker)
                self._index.add_worker(worker_id)
                self._start_resync(stream)
            else:
                self._streams[worker_id].worker = worker  # e.g. is_draining changed

    async def close(self) -> None:
        for stream in list(self._streams.values()):
            self._drop(stream)
        if self._receiver is not None:
            self._receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._receiver
        self._socket.close(linger=0)

    # ------------------------------------------------------------------ status
    def is_synced(self, worker_id: str) -> bool:
        stream = self._streams.get(worker_id)
        return stream is not None and stream.buffer is None

    def stats(self, worker_id: str) -> StreamStats:
        stream = self._streams[worker_id]
        return StreamStats(stream.last_sequence, stream.num_messages, stream.num_gaps, stream.num_resyncs)

    async def wait_synced(self, worker_id: str, min_sequence: int = 0) -> None:
        """Returns once the worker is live with every event up to `min_sequence` applied."""
        async with self._synced:
            await self._synced.wait_for(
                lambda: self.is_synced(worker_id) and self._streams[worker_id].last_sequence >= min_sequence
            )

    # --------------------------------------------------------------- internals
    def _drop(self, stream: _Stream) -> None:
        worker = stream.worker
        if stream.resync is not None:
            stream.resync.cancel()
        with contextlib.suppress(zmq.ZMQError):
            self._socket.disconnect(worker.kv_events_endpoint)
        self._index.drop_worker(worker.worker_id)
        del self._streams[worker.worker_id]

    async def _receive(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != _SEQUENCE.size:
                log.warning("ignoring a malformed KV-event message of %d frames", len(frames))
                continue
            stream = self._streams.get(frames[0].decode(errors="replace"))
            if stream is not None:
                self._on_message(stream, _SEQUENCE.unpack(frames[1])[0], frames[2])
                await self._notify()

    def _on_message(self, stream: _Stream, sequence: int, payload: bytes) -> None:
        stream.num_messages += 1
        if stream.buffer is not None:
            if len(stream.buffer) >= self._max_buffered:
                stream.buffer.clear()  # the next GetBlockSet covers them; a gap after it resyncs again
            stream.buffer.append((sequence, payload))
        elif sequence <= stream.last_sequence:
            pass  # stale: already reflected by the last GetBlockSet answer
        elif sequence == stream.last_sequence + 1 and self._apply(stream, payload):
            stream.last_sequence = sequence
        else:
            stream.num_gaps += 1
            log.info("KV events of %s: got %d after %d; resyncing", stream.worker.worker_id, sequence, stream.last_sequence)
            stream.buffer = [(sequence, payload)]
            self._start_resync(stream)

    def _apply(self, stream: _Stream, payload: bytes) -> bool:
        """Applies one message; False if it cannot be decoded (treated like a gap)."""
        if stream.is_broken:
            return True
        try:
            events = kv_events_from_bytes(payload)
        except ValueError as e:
            log.warning("KV events of %s: undecodable message (%s)", stream.worker.worker_id, e)
            return False
        for event in events:
            self._apply_event(stream, event)
        return True

    def _apply_event(self, stream: _Stream, event: KVEvent) -> None:
        worker_id = stream.worker.worker_id
        if isinstance(event, BlocksStored):
            if event.block_size != self._block_size:
                self._break(stream, event.block_size)
                return
            self._index.store(worker_id, event.block_hashes)
        elif isinstance(event, BlocksRemoved):
            self._index.remove(worker_id, event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self._index.clear(worker_id)

    def _break(self, stream: _Stream, block_size: int) -> None:
        log.error(
            "worker %r reports KV block size %r, the router uses %r: ignoring its KV events",
            stream.worker.worker_id, block_size, self._block_size,
        )  # fmt: skip
        stream.is_broken = True
        self._index.clear(stream.worker.worker_id)

    def _start_resync(self, stream: _Stream) -> None:
        if stream.resync is None or stream.resync.done():
            stream.resync = asyncio.create_task(self._resync(stream), name=f"kv-resync-{stream.worker.worker_id}")

    async def _resync(self, stream: _Stream) -> None:
        delay = self._retry_delay_s
        while True:
            try:
                block_set = await self._fetch(stream.worker)
            except Exception as e:  # the worker may be starting or gone: retry until dropped
                level = logging.WARNING if delay == self._retry_delay_s else logging.DEBUG
                log.log(level, "GetBlockSet of %s failed (%s); retrying", stream.worker.worker_id, e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _MAX_RETRY_DELAY_S)
                continue
            delay = self._retry_delay_s
            stream.num_resyncs += 1
            if block_set.block_size != self._block_size:
                self._break(stream, block_set.block_size)
            elif not stream.is_broken:
                self._index.replace(stream.worker.worker_id, block_set.block_hashes)
            last = block_set.event_sequence
            pending, stream.buffer = stream.buffer or [], None
            is_contiguous = True
            for sequence, payload in pending:
                if sequence <= last:
                    continue
                if sequence != last + 1 or not self._apply(stream, payload):
                    is_contiguous = False
                    break
                last = sequence
            stream.last_sequence = last
            if is_contiguous:
                await self._notify()
                return
            stream.num_gaps += 1
            stream.buffer = [item for item in pending if item[0] > last]

    async def _notify(self) -> None:
        async with self._synced:
            self._synced.notify_all()
