"""`KVEventPublisher`: a worker's prefix-cache changes, published for routers (torch-free).

    publisher = KVEventPublisher(worker_id, block_size=16)     # binds tcp://127.0.0.1:<free port>
    registration = WorkerRegistration(..., kv_events_endpoint=publisher.endpoint, kv_block_size=16)
    ...
    publisher.publish(engine.pool.drain_events())             # after every engine step (rank 0)
    return publisher.block_set(engine.pool.cached_hashes())   # GetBlockSet, on the engine thread
    publisher.close()

Wire format (proto/splitserve/v1/kv_events.proto): one ZMQ message per
`publish` call with events, three frames [worker id, sequence as 8-byte
big-endian, KVEventBatch]; the sequence starts at 1 and grows by one per
message. `publish` never blocks: a PUB socket drops messages for a
subscriber that is too slow (send high-water mark) and this class drops a
message ZMQ refuses. Either way its sequence number is used up, so the
subscriber sees the gap and resynchronises through GetBlockSet, whose
`event_sequence` (`last_sequence` here) says which events the set reflects.

Not thread-safe (ZMQ sockets are not): call every method from one thread,
the engine loop's, so that `block_set` sees the cache exactly as of
`last_sequence`.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterable, Sequence

import zmq

from splitserve.engine.block_hash import BlockHash
from splitserve.engine.block_pool import BlockEvent
from splitserve.proto.v1 import kv_events_pb2, prefill_worker_pb2

log = logging.getLogger(__name__)

_SEQUENCE = struct.Struct(">Q")


def encode_events(events: Sequence[BlockEvent], block_size: int) -> kv_events_pb2.KVEventBatch:
    """The batch message of `events`; consecutive stored blocks of one chain share one BlockStored."""
    batch = kv_events_pb2.KVEventBatch()
    stored: kv_events_pb2.BlockStored | None = None
    last_stored: BlockHash | None = None
    for event in events:
        if event.kind == "stored":
            if stored is not None and event.parent_hash is not None and event.parent_hash == last_stored:
                stored.block_hashes.extend(event.block_hashes)
            else:
                stored = batch.events.add().stored
                stored.block_hashes.extend(event.block_hashes)
                stored.parent_hash = event.parent_hash or b""
                stored.block_size = block_size
            last_stored = event.block_hashes[-1] if event.block_hashes else last_stored
            continue
        stored = last_stored = None
        if event.kind == "removed":
            batch.events.add().removed.block_hashes.extend(event.block_hashes)
        elif event.kind == "cleared":
            batch.events.add().all_cleared.SetInParent()
        else:
            raise ValueError(f"unknown block event kind {event.kind!r}")
    return batch


class KVEventPublisher:
    """One worker's KV-event PUB socket (see the module docstring)."""

    def __init__(
        self,
        worker_id: str,
        block_size: int,
        endpoint: str = "tcp://127.0.0.1:0",
        *,
        send_hwm: int = 100_000,
        context: zmq.Context | None = None,
    ) -> None:
        """Binds `endpoint` at once (port 0 picks a free port); `send_hwm` = messages queued per subscriber."""
        if not isinstance(worker_id, str) or not worker_id:
            raise ValueError(f"worker_id must be a non-empty string, got {worker_id!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.worker_id = worker_id
        self.block_size = block_size
        self._topic = worker_id.encode()
        self._socket = (context or zmq.Context.instance()).socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, send_hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as e:
            self._socket.close()
            raise ValueError(f"cannot bind KV-event endpoint {endpoint!r}: {e}") from e
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        """The bound address, e.g. tcp://127.0.0.1:40123: advertise it as the worker's kv_events_endpoint."""
        self.last_sequence = 0
        """Sequence number of the last message published (0 = none yet)."""
        self.num_dropped = 0
        """Messages ZMQ refused to queue (their sequence numbers are used up: subscribers resync)."""

    def publish(self, events: Sequence[BlockEvent]) -> None:
        """Sends `events` (from BlockPool.drain_events) as one message; never blocks, does nothing if empty."""
        if not events:
            return
        self.last_sequence += 1
        payload = encode_events(events, self.block_size).SerializeToString()
        try:
            self._socket.send_multipart(
                (self._topic, _SEQUENCE.pack(self.last_sequence), payload), flags=zmq.NOBLOCK, copy=False
            )
        except zmq.Again:
            self.num_dropped += 1
            log.debug("KV events of %s: message %d dropped (queue full)", self.worker_id, self.last_sequence)

    def block_set(self, block_hashes: Iterable[BlockHash]) -> prefill_worker_pb2.BlockSet:
        """The GetBlockSet reply for the cache's current hashes (BlockPool.cached_hashes()).

        Call on the publishing thread after publishing every drained event,
        so that the set is exactly the state after message `last_sequence`.
        """
        return prefill_worker_pb2.BlockSet(
            block_digests=list(block_hashes), block_size=self.block_size, event_sequence=self.last_sequence
        )

    def close(self) -> None:
        self._socket.close(linger=0)
