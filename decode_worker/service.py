"""`splitserve.v1.DecodeWorker` over gRPC (asyncio): import a handoff (or prefill
locally when there is none), acknowledge it to the prefill worker, stream tokens.

Failure rules: a failed or corrupt pull is retried once from the pinned copy,
then the prompt is recomputed here — the client sees no error either way. A
cancelled stream aborts the request on every rank. Bad input → INVALID_ARGUMENT;
a full engine → RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import grpc

from splitserve.decode_worker.hooks import ImportOutcome
from splitserve.engine.block_pool import NoFreeBlocksError
from splitserve.engine.handoff_push import PushGrant, PushRefusedError, PushRequest
from splitserve.engine.serving import Command
from splitserve.engine.transfer.transport import TransferError
from splitserve.engine.wire import (
    descriptor_from_proto,
    finish_reason,
    grant_from_proto,
    push_to_proto,
    sampling_from_proto,
    top_logprobs_to_proto,
)
from splitserve.engine.worker_runtime import WorkerGroup
from splitserve.proto.v1 import common_pb2, decode_worker_pb2, decode_worker_pb2_grpc, prefill_worker_pb2
from splitserve.proto.v1 import prefill_worker_pb2_grpc as prefill_grpc

log = logging.getLogger(__name__)

#: PushKV answers meaning "decided not to push": nothing was or will be sent.
_REFUSALS = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)


class DecodeWorkerService(decode_worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, group: WorkerGroup, pull_timeout_s: float = 30.0, pull_attempts: int = 2):
        self.group = group
        self.loop = group.loop
        self.state = group.state
        self.engine = group.engine
        self.pull_timeout_s = pull_timeout_s
        self.pull_attempts = pull_attempts
        self.last_import: ImportOutcome | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._push_channels: dict[str, grpc.Channel] = {}  # sync: used from the engine thread
        self.state.ask_push = self._ask_push

    async def _submit(self, command: Command):
        return await asyncio.wrap_future(self.loop.submit(command))

    async def Decode(self, request, context):  # noqa: N802 - gRPC method name
        if self.group.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker is draining; use another")
        self.group.num_in_flight += 1
        try:
            async for chunk in self._decode(request, context):
                yield chunk
        finally:
            self.group.num_in_flight -= 1

    async def _decode(self, request, context):
        request_id = request.request_id or uuid.uuid4().hex
        token_ids = list(request.token_ids)
        try:
            params = sampling_from_proto(request.sampling_params)
            desc = descriptor_from_proto(request.handoff) if request.HasField("handoff") else None
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        queue: asyncio.Queue = asyncio.Queue()
        self.state.streams[request_id] = (asyncio.get_running_loop(), queue)
        finished = False
        try:
            first_chunk = await self._admit(request_id, token_ids, params, desc, request.prefill_address, context)
            if first_chunk is not None:
                yield first_chunk
                finished = first_chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
            while not finished:
                out = await queue.get()
                result = out.result
                chunk = decode_worker_pb2.DecodeChunk(token_ids=list(out.new_token_ids))
                if len(result.generated_tokens) == 1:  # prefilled here: report its prefix-cache hit
                    chunk.num_cached_tokens = result.num_cached_tokens
                if params.return_log_probs and result.generated_log_probs:
                    chunk.logprobs.append(result.generated_log_probs[-1])
                if params.top_n_logprobs and result.top_n_logprobs:
                    chunk.top_logprobs.append(top_logprobs_to_proto(result.top_n_logprobs[-1]))
                if result.is_finished:
                    chunk.finish_reason = finish_reason(result)
                    finished = True
                yield chunk
        finally:
            self.state.streams.pop(request_id, None)
            if not finished:  # cancelled or failed mid-stream: free the work everywhere
                self.loop.submit(Command("abort", request_id))

    async def _admit(self, request_id, token_ids, params, desc, prefill_address, context):
        """Start the request; return the first chunk for a handoff (the prefill's token)."""
        try:
            if desc is None:
                await self._submit(Command("add", request_id, (token_ids, params)))
                return None
            error: Exception | None = None
            for attempt in range(self.pull_attempts):
                try:
                    self.last_import = await self._submit(
                        Command("import", request_id, (token_ids, params, desc, self.pull_timeout_s, prefill_address))
                    )
                    error = None
                    break
                except TransferError as exc:
                    error = exc
                    log.warning("pull of %s failed (attempt %d): %s", request_id, attempt + 1, exc)
            self._release_later(prefill_address, request_id)
            if error is not None:  # recompute here rather than fail the client
                await self._submit(Command("add", request_id, (token_ids, params)))
                return None
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except NoFreeBlocksError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except RuntimeError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        chunk = decode_worker_pb2.DecodeChunk(token_ids=[desc.first_token_id])
        if params.return_log_probs and desc.first_token_logprob is not None:
            chunk.logprobs.append(desc.first_token_logprob)
        if params.top_n_logprobs and desc.first_token_top_logprobs:
            chunk.top_logprobs.append(top_logprobs_to_proto(desc.first_token_top_logprobs))
        if params.max_new_tokens(len(token_ids)) <= 1:
            chunk.finish_reason = common_pb2.FINISH_REASON_LENGTH
        return chunk

    def _release_later(self, address: str, request_id: str) -> None:
        """Ack the pull so the prefill side unpins now rather than at lease expiry."""
        if not address:
            return

        async def release():
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = grpc.aio.insecure_channel(address)
            try:
                await prefill_grpc.PrefillWorkerStub(channel).Release(
                    prefill_worker_pb2.ReleaseRequest(request_id=request_id), timeout=5.0
                )
            except grpc.aio.AioRpcError as exc:  # the lease frees the pins anyway
                log.warning("release of %s at %s failed: %s", request_id, address, exc.code())

        asyncio.get_running_loop().create_task(release())

    def _ask_push(self, address: str, push: PushRequest) -> PushGrant:
        """torch_dist: PushKV on the prefill worker (engine thread, blocking until it decided)."""
        channel = self._push_channels.get(address)
        if channel is None:
            channel = self._push_channels[address] = grpc.insecure_channel(address)
        try:
            reply = prefill_grpc.PrefillWorkerStub(channel).PushKV(push_to_proto(push), timeout=push.timeout_s)
        except grpc.RpcError as exc:
            # Only the prefill's own "no" guarantees it sends nothing; after a lost answer or our
            # deadline it may be sending, so the pair group must not be reused (TransferError).
            kind = PushRefusedError if exc.code() in _REFUSALS else TransferError
            raise kind(f"PushKV at {address}: {exc.code().name}: {exc.details()}") from exc
        return grant_from_proto(reply)

    async def GetBlockSet(self, request, context):  # noqa: N802
        return await self._submit(Command("block_set"))  # a BlockSet built on the engine thread

    async def Abort(self, request, context):  # noqa: N802
        found = await self._submit(Command("abort", request.request_id))
        return common_pb2.AbortResponse(was_found=bool(found))


def add_decode_service(server: grpc.aio.Server, group: WorkerGroup) -> str:
    decode_worker_pb2_grpc.add_DecodeWorkerServicer_to_server(DecodeWorkerService(group), server)
    return "splitserve.v1.DecodeWorker"
