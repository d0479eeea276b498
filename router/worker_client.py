"""`GrpcWorkerClient`: the router's calls to PrefillWorker and DecodeWorker services.

One channel per worker address, opened on first use and closed when the
worker leaves the topology (`set_workers`) or at `close()`. Every call has
a deadline. gRPC failures become `WorkerCallError` so the orchestrator can
retry without knowing about gRPC; protobuf conversion is in service.py. Every call carries the
current trace context (W3C traceparent) in its metadata.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping

import grpc

from splitserve import grpc_security
from splitserve.control_plane.shard_spec import Role
from splitserve.proto.v1 import (
    common_pb2,
    decode_worker_pb2,
    decode_worker_pb2_grpc,
    prefill_worker_pb2,
    prefill_worker_pb2_grpc,
)
from splitserve.router.messages import (
    BlockSetSnapshot,
    DecodeOutput,
    GenerateRequest,
    PrefillFirstToken,
    PrefillHandoffStarted,
    PrefillResult,
    WorkerCallError,
)
from splitserve.router.service import (
    block_set_from_proto,
    decode_output_from_proto,
    decode_request_to_proto,
    first_token_from_proto,
    prefill_request_to_proto,
    prefill_result_from_proto,
)
from splitserve.router.workers import WorkerEndpoint
from splitserve.telemetry.propagation import inject_metadata


def _error(worker: WorkerEndpoint, method: str, e: grpc.aio.AioRpcError) -> WorkerCallError:
    return WorkerCallError(worker.worker_id, method, e.code(), e.details() or "")


@contextlib.contextmanager
def _call_errors(worker: WorkerEndpoint, method: str) -> Iterator[None]:
    """gRPC failures of a call as WorkerCallError. A CancelledError out of a call whose awaiting task
    is not itself being cancelled comes from gRPC when the call's channel closes under it: that is the
    worker's failure (UNAVAILABLE, retried like one), not a cancelled request."""
    try:
        yield
    except grpc.aio.AioRpcError as e:
        raise _error(worker, method, e) from e
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling() > 0:
            raise
        raise WorkerCallError(worker.worker_id, method, grpc.StatusCode.UNAVAILABLE, "the call was cancelled under "
                              "us (its channel closed: the worker left the topology)") from None  # fmt: skip


class DecodeCall:
    """A running DecodeWorker.Decode stream: iterate for outputs, `cancel()` to end it."""

    def __init__(self, worker: WorkerEndpoint, call: grpc.aio.UnaryStreamCall) -> None:
        self._worker = worker
        self._call = call

    async def __aiter__(self) -> AsyncIterator[DecodeOutput]:
        with _call_errors(self._worker, "Decode"):
            async for message in self._call:
                yield decode_output_from_proto(message)

    def cancel(self) -> None:
        self._call.cancel()


class PrefillStreamCall:
    """A running PrefillWorker.PrefillStream: iterate for [a PrefillHandoffStarted,] a PrefillFirstToken,
    then the PrefillResult; `cancel()` to end it (the worker then aborts the request)."""

    def __init__(self, worker: WorkerEndpoint, call: grpc.aio.UnaryStreamCall) -> None:
        self._worker = worker
        self._call = call

    async def __aiter__(self) -> AsyncIterator[PrefillHandoffStarted | PrefillFirstToken | PrefillResult]:
        first: PrefillFirstToken | None = None
        has_result = False
        try:
            with _call_errors(self._worker, "PrefillStream"):
                async for message in self._call:
                    kind = message.WhichOneof("event")
                    if kind == "handoff_started" and first is None and not has_result:
                        yield PrefillHandoffStarted(message.handoff_started.SerializeToString())
                    elif kind == "first_token" and first is None and not has_result:
                        first = first_token_from_proto(message.first_token)
                        yield first
                    elif kind == "response" and not has_result:
                        has_result = True
                        yield prefill_result_from_proto(message.response, first.first if first else None)
        except ValueError as e:
            raise WorkerCallError(self._worker.worker_id, "PrefillStream", grpc.StatusCode.INTERNAL, str(e)) from e
        if not has_result:
            raise WorkerCallError(
                self._worker.worker_id, "PrefillStream", grpc.StatusCode.INTERNAL, "stream ended without a response"
            )

    def cancel(self) -> None:
        self._call.cancel()


class GrpcWorkerClient:
    """Calls workers over gRPC (one event loop)."""

    def __init__(self, departed_grace_s: float = 60.0) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._departed: set[grpc.aio.Channel] = set()
        self._departed_grace_s = departed_grace_s
        """How long the calls still running on a worker that left the topology may go on (its etcd lease
        may have lapsed for a moment while it kept serving) before its channel is closed under them."""

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc_security.aio_channel(address)
        return self._channels[address]

    def prefill_stream(
        self, worker: WorkerEndpoint, request: GenerateRequest, decode_worker_id: str, timeout_s: float,
        decode_tp: int = 0,
    ) -> PrefillStreamCall:
        """Starts PrefillStream now (with the current trace context); `timeout_s` bounds the whole stream.
        `decode_tp`: the decode worker's TP size (0 = unknown), for packing on the prefill side."""
        stub = prefill_worker_pb2_grpc.PrefillWorkerStub(self._channel(worker.address))
        message = prefill_request_to_proto(request, decode_worker_id, decode_tp)
        return PrefillStreamCall(worker, stub.PrefillStream(message, timeout=timeout_s, metadata=inject_metadata()))

    def decode(
        self,
        worker: WorkerEndpoint,
        request: GenerateRequest,
        handoff: bytes | None,
        prefill_address: str | None,
        timeout_s: float,
    ) -> DecodeCall:
        stub = decode_worker_pb2_grpc.DecodeWorkerStub(self._channel(worker.address))
        message = decode_request_to_proto(request, handoff, prefill_address)
        return DecodeCall(worker, stub.Decode(message, timeout=timeout_s, metadata=inject_metadata()))

    async def prefetch(
        self, worker: WorkerEndpoint, request: GenerateRequest, preview: bytes, timeout_s: float
    ) -> tuple[bool, str]:
        """DecodeWorker.Prefetch: (accepted, reason declined)."""
        stub = decode_worker_pb2_grpc.DecodeWorkerStub(self._channel(worker.address))
        message = decode_worker_pb2.PrefetchRequest(request_id=request.request_id, token_ids=request.token_ids)
        message.handoff.ParseFromString(preview)
        with _call_errors(worker, "Prefetch"):
            reply = await stub.Prefetch(message, timeout=timeout_s, metadata=inject_metadata())
        return reply.accepted, reply.reason

    async def abort(self, worker: WorkerEndpoint, request_id: str, timeout_s: float) -> bool:
        """Abort on the worker's service; False if it did not know the request."""
        channel = self._channel(worker.address)
        stub = (
            prefill_worker_pb2_grpc.PrefillWorkerStub(channel)
            if worker.role is Role.PREFILL
            else decode_worker_pb2_grpc.DecodeWorkerStub(channel)
        )
        with _call_errors(worker, "Abort"):
            reply = await stub.Abort(
                common_pb2.AbortRequest(request_id=request_id), timeout=timeout_s, metadata=inject_metadata()
            )
        return reply.was_found

    async def get_block_set(self, worker: WorkerEndpoint, timeout_s: float) -> BlockSetSnapshot:
        channel = self._channel(worker.address)
        stub = (
            prefill_worker_pb2_grpc.PrefillWorkerStub(channel)
            if worker.role is Role.PREFILL
            else decode_worker_pb2_grpc.DecodeWorkerStub(channel)
        )
        with _call_errors(worker, "GetBlockSet"):
            reply = await stub.GetBlockSet(prefill_worker_pb2.GetBlockSetRequest(), timeout=timeout_s)
        return block_set_from_proto(reply)

    async def set_workers(self, workers: Mapping[str, WorkerEndpoint]) -> None:
        """Closes the channels of addresses no worker uses any more."""
        in_use = {worker.address for worker in workers.values()}
        departed = [self._channels.pop(a) for a in list(self._channels) if a not in in_use]
        self._departed.update(departed)
        try:
            await asyncio.gather(*(channel.close(self._departed_grace_s) for channel in departed))
        finally:
            self._departed.difference_update(departed)

    async def close(self) -> None:
        for channel in [*self._channels.values(), *self._departed]:
            await channel.close()
        self._channels.clear()
        self._departed.clear()
