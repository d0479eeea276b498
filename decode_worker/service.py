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
import time
import uuid
from dataclasses import dataclass, field

import grpc
from opentelemetry import context as otel_context

from splitserve import grpc_security
from splitserve.decode_worker.admission import DecodeAdmission
from splitserve.decode_worker.hooks import ImportOutcome
from splitserve.engine import fault_injection
from splitserve.engine.block_pool import NoFreeBlocksError
from splitserve.engine.handoff_push import PushGrant, PushRefusedError, PushRequest
from splitserve.engine.serving import Command
from splitserve.engine.state_handoff import missing_state
from splitserve.engine.transfer.layout import layout_text
from splitserve.engine.transfer.transport import TransferError, TransferStats
from splitserve.engine.wire import (
    descriptor_from_proto,
    finish_reason,
    grant_from_proto,
    prompt_logprobs_to_proto,
    push_to_proto,
    sampling_from_proto,
    top_logprobs_to_proto,
)
from splitserve.engine.worker_integrity import integrity_to_proto
from splitserve.engine.worker_runtime import WorkerGroup
from splitserve.engine.worker_server import unavailable_when_stopped
from splitserve.proto.v1 import common_pb2, decode_worker_pb2, decode_worker_pb2_grpc, prefill_worker_pb2
from splitserve.proto.v1 import prefill_worker_pb2_grpc as prefill_grpc
from splitserve.telemetry.spans import (
    FIRST_MESSAGE,
    detach_quietly,
    emit_span,
    mark_error,
    mono_to_unix_ns,
    start_server_span,
)

log = logging.getLogger(__name__)

PREFETCH_ANSWER_S = 1.0
"""How long Prefetch waits for the engine thread to take the prefetch up before it answers "queued":
the router reads a Prefetch without an answer as a hung worker (router/decode_relay.py), and a
long engine step (a big prefill on a CPU) must not look like one."""
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
        self.metrics = group.metrics
        self.last_import: ImportOutcome | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._push_channels: dict[str, grpc.Channel] = {}  # sync: used from the engine thread
        self.state.ask_push = self._ask_push
        self.admission = DecodeAdmission(self.engine.config.scheduler.max_requests, self.metrics)
        """Room for each Decode (decode_worker/admission.py): a burst waits rather than fail."""

    async def _submit(self, command: Command):
        return await asyncio.wrap_future(self.loop.submit(command))

    async def Decode(self, request, context):  # noqa: N802 - gRPC method name
        clock = _DecodeClock(time.monotonic())
        span, span_context = start_server_span("decode.request", context.invocation_metadata(), {
            "rpc.system": "grpc", "rpc.service": "splitserve.v1.DecodeWorker", "rpc.method": "Decode",
            "splitserve.request_id": request.request_id, "splitserve.prompt_tokens": len(request.token_ids),
            "splitserve.handoff": request.HasField("handoff"),
        })  # fmt: skip
        token = otel_context.attach(span_context)  # this task's, for logs; child spans get the context explicitly
        outcome = "cancelled"
        try:
            if self.group.draining:
                self.metrics.rejections.labels("decode", "draining").inc()
                await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker is draining; use another")
            self.group.num_in_flight += 1
            try:
                async for chunk in self._decode(request, context, clock, span):
                    if clock.first_chunk is None:
                        clock.first_chunk = time.monotonic()
                        span.add_event(FIRST_MESSAGE)
                    if chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                        outcome = common_pb2.FinishReason.Name(chunk.finish_reason).removeprefix("FINISH_REASON_").lower()
                        clock.last_chunk = time.monotonic()
                        chunk.timing.CopyFrom(clock.timing())
                        self._record(clock, span_context)
                    yield chunk
            finally:
                self.group.num_in_flight -= 1
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            outcome = "error"
            mark_error(span, exc)
            raise
        finally:
            self.metrics.requests.labels("decode", outcome).inc()
            span.set_attribute("splitserve.outcome", outcome)
            span.end()
            detach_quietly(token)

    async def Prefetch(self, request, context):  # noqa: N802
        """Start pulling a handoff prefill is still computing (advisory: declined → Decode pulls)."""
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a prefetch needs the request id")
        try:
            preview = descriptor_from_proto(request.handoff)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not self.state.accepts_prefetch:
            return decode_worker_pb2.PrefetchResponse(
                reason="this decode worker does not prefetch (needs --layerwise and a pull transport, no hybrid model)")
        if self.group.draining:
            return decode_worker_pb2.PrefetchResponse(reason="draining")
        if not preview.is_preview:
            return decode_worker_pb2.PrefetchResponse(reason="not a preview (it has block checksums): call Decode")
        future = asyncio.wrap_future(self.loop.submit(Command("prefetch", request.request_id,
                                                              (list(request.token_ids), preview))))  # fmt: skip
        future.add_done_callback(self._prefetch_done)
        try:
            await asyncio.wait_for(asyncio.shield(future), PREFETCH_ANSWER_S)
        except TimeoutError:  # queued behind a long step: it runs before any later import all the same
            return decode_worker_pb2.PrefetchResponse(accepted=True, reason="queued behind a running step")
        except (ValueError, NoFreeBlocksError, TransferError) as exc:
            return decode_worker_pb2.PrefetchResponse(reason=f"{type(exc).__name__}: {exc}")
        except RuntimeError as exc:  # the engine loop stopped
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return decode_worker_pb2.PrefetchResponse(accepted=True)

    def _prefetch_done(self, future: asyncio.Future) -> None:
        exc = None if future.cancelled() else future.exception()
        if isinstance(exc, (ValueError, NoFreeBlocksError, TransferError)):
            self.metrics.rejections.labels("decode", "prefetch_declined").inc()
            log.info("prefetch declined: %s: %s", type(exc).__name__, exc)

    async def _decode(self, request, context, clock: _DecodeClock, span):
        request_id = request.request_id or uuid.uuid4().hex
        token_ids = list(request.token_ids)
        try:
            params = sampling_from_proto(request.sampling_params)
            desc = descriptor_from_proto(request.handoff) if request.HasField("handoff") else None
            if desc is not None and desc.is_preview:
                raise ValueError("the handoff is a preview (no block checksums): send it to Prefetch, "
                                 "and the response's full handoff to Decode")
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        await self.admission.take_slot(desc, context)
        queue: asyncio.Queue = asyncio.Queue()
        self.state.streams[request_id] = (asyncio.get_running_loop(), queue)
        finished = False
        try:
            first_chunk = await self._admit(request_id, token_ids, params, desc, request.prefill_address, context, clock, span)
            if first_chunk is not None:
                yield first_chunk
                finished = first_chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
            while not finished:
                out = await queue.get()
                if out is None:  # aborted (Abort RPC): end the stream with a final chunk
                    yield decode_worker_pb2.DecodeChunk(finish_reason=common_pb2.FINISH_REASON_ABORT)
                    finished = True
                    break
                result = out.result  # None but for a first token and the end (decode_hooks: no snapshots)
                clock.on_output(result, len(out.new_token_ids), self.metrics)
                chunk = decode_worker_pb2.DecodeChunk(token_ids=list(out.new_token_ids))
                if out.num_generated == 1 and result is not None:  # prefilled here: its prefix-cache hit
                    chunk.num_cached_tokens = result.num_cached_tokens
                    if (prompt := prompt_logprobs_to_proto(result)) is not None:
                        chunk.prompt_logprobs.CopyFrom(prompt)
                if params.return_log_probs:
                    chunk.logprobs.extend(out.new_log_probs)
                if params.top_n_logprobs:
                    chunk.top_logprobs.extend(top_logprobs_to_proto(t) for t in out.new_top_n)
                if result is not None and result.is_finished:
                    chunk.finish_reason = finish_reason(result)
                    finished = True
                await fault_injection.hold("stream", request_id)
                yield chunk
        finally:
            self.state.streams.pop(request_id, None)
            if finished:  # the engine freed its blocks before its last output
                self.admission.release()
            else:  # cancelled or failed mid-stream: free the work everywhere, then the slot
                self.admission.release_after(self.loop.submit(Command("abort", request_id)))

    async def _admit(self, request_id, token_ids, params, desc, prefill_address, context, clock, span):
        """Start the request; return the first chunk for a handoff (the prefill's token)."""
        try:
            if desc is None:
                await self._submit(Command("add", request_id, (token_ids, params)))
                return None
            await fault_injection.hold("transfer", request_id)
            error: Exception | None = None
            if (reason := missing_state(self.engine, desc)) is not None:  # nothing to pull that could continue it
                log.warning("handoff of %s: %s; recomputing the prompt here", request_id, reason)
                error = TransferError(reason)
            for attempt in range(self.pull_attempts if error is None else 0):
                try:
                    command = Command("import", request_id, (token_ids, params, desc, self.pull_timeout_s, prefill_address))
                    self.last_import = await self.admission.import_when_room(lambda c=command: self._submit(c), desc)
                    clock.on_import(self.last_import, desc, self.metrics)
                    error = None
                    break
                except TransferError as exc:
                    error = exc
                    self.metrics.transfer_failures.labels("decode").inc()
                    span.add_event("kv_transfer_failed", {"attempt": attempt + 1, "error": str(exc)[:200]})
                    log.warning("pull of %s failed (attempt %d): %s", request_id, attempt + 1, exc)
            self._release_later(prefill_address, request_id)
            if error is not None:  # recompute here rather than fail the client
                clock.import_failed = True
                await self._submit(Command("add", request_id, (token_ids, params)))
                return None
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except NoFreeBlocksError as exc:
            self.metrics.rejections.labels("decode", "no_free_blocks").inc()
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

    def _record(self, clock: _DecodeClock, parent) -> None:
        """The phase spans of a finished stream (children of its decode.request span) and its metrics."""
        m = self.metrics
        for name, start, end, attributes, is_ttft in clock.phases():
            emit_span(name, mono_to_unix_ns(start), mono_to_unix_ns(end), attributes, parent=parent, is_ttft_phase=is_ttft)
        if clock.queue_end is not None:
            m.queue_seconds.labels("decode").observe(clock.queue_end - clock.started)

    def _release_later(self, address: str, request_id: str) -> None:
        """Ack the pull so the prefill side unpins now rather than at lease expiry."""
        if not address:
            return

        async def release():
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = grpc_security.aio_channel(address)
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
            channel = self._push_channels[address] = grpc_security.sync_channel(address)
        try:
            reply = prefill_grpc.PrefillWorkerStub(channel).PushKV(push_to_proto(push), timeout=push.timeout_s)
        except grpc.RpcError as exc:
            # Only the prefill's own "no" guarantees it sends nothing; after a lost answer or our
            # deadline it may be sending, so the pair group must not be reused (TransferError).
            kind = PushRefusedError if exc.code() in _REFUSALS else TransferError
            raise kind(f"PushKV at {address}: {exc.code().name}: {exc.details()}") from exc
        return grant_from_proto(reply)

    @unavailable_when_stopped
    async def GetBlockSet(self, request, context):  # noqa: N802
        return await self._submit(Command("block_set"))  # a BlockSet built on the engine thread

    @unavailable_when_stopped
    async def CheckIntegrity(self, request, context):  # noqa: N802
        report = await self._submit(Command("integrity"))
        return integrity_to_proto(report, num_in_flight=self.group.num_in_flight, is_draining=self.group.draining)

    @unavailable_when_stopped
    async def Abort(self, request, context):  # noqa: N802
        found = await self._submit(Command("abort", request.request_id))
        entry = self.state.streams.get(request.request_id)
        if entry is not None:  # wake its stream: no more outputs will come for it
            entry[1].put_nowait(None)
        return common_pb2.AbortResponse(was_found=bool(found))


@dataclass
class _DecodeClock:
    """The instants (`time.monotonic()`) of one Decode stream, for its spans, metrics and DecodeTiming."""

    started: float
    queue_end: float | None = None
    """Handoff: the import began on the engine thread. Without: the first prompt chunk's step."""
    import_end: float | None = None
    first_token: float | None = None
    """Without a handoff: the first token sampled here."""
    first_output: float | None = None
    """The first engine output delivered to the stream."""
    first_chunk: float | None = None
    last_chunk: float | None = None
    last_output: float | None = None
    stats: TransferStats | None = None
    transport: str = ""
    transfer_attributes: dict = field(default_factory=dict)
    import_failed: bool = False
    prefetched: bool = False

    def on_import(self, outcome: ImportOutcome, desc, metrics) -> None:
        self.queue_end, self.import_end, self.stats = outcome.started, outcome.finished, outcome.stats
        self.transport = desc.transport_kind
        self.prefetched = outcome.prefetched
        stats = outcome.stats or TransferStats(0, 0.0, 0)
        self.transfer_attributes = {
            "splitserve.kv.bytes": stats.num_bytes, "splitserve.kv.seconds": stats.seconds,
            "splitserve.kv.gbps": stats.gbps, "splitserve.kv.regions": stats.num_regions,
            "splitserve.kv.transport": desc.transport_kind, "splitserve.kv.src_layout": layout_text(desc.layout),
            "splitserve.kv.dst_layout": outcome.dst_layout, "splitserve.kv.reused_blocks": outcome.num_reused_blocks,
            "splitserve.kv.blocks": len(desc.block_checksums), "splitserve.kv.prefetched": outcome.prefetched,
        }  # fmt: skip
        metrics.transfer_bytes.labels("decode", desc.transport_kind).inc(stats.num_bytes)
        metrics.transfer_seconds.labels("decode", desc.transport_kind).inc(stats.seconds)
        metrics.transfer_size.labels("decode", desc.transport_kind).observe(stats.num_bytes)

    def on_output(self, result, num_tokens: int, metrics) -> None:
        now = time.monotonic()
        if self.first_output is None:
            self.first_output = now
            t = result.timing if result is not None else None
            if self.import_end is None and t is not None:  # prefilled here
                self.queue_end = t.first_scheduled if t.first_scheduled is not None else self.started
                self.first_token = t.first_token if t.first_token is not None else now
                metrics.prefill_seconds.labels("decode").observe(self.first_token - self.queue_end)
            metrics.ttft_seconds.labels("decode").observe((self.first_token or now) - self.started)
        elif self.last_output is not None and num_tokens:
            metrics.itl_seconds.labels("decode").observe((now - self.last_output) / num_tokens)
        self.last_output = now

    def timing(self) -> decode_worker_pb2.DecodeTiming:
        def ms(a: float | None, b: float | None) -> float:
            return (b - a) * 1e3 if a is not None and b is not None and b > a else 0.0

        t = decode_worker_pb2.DecodeTiming(
            queue_ms=ms(self.started, self.queue_end), first_chunk_ms=ms(self.started, self.first_chunk),
            stream_ms=ms(self.first_chunk, self.last_chunk), transport=self.transport,
        )  # fmt: skip
        if self.import_end is not None:
            t.transfer_ms = ms(self.queue_end, self.import_end)
            t.first_step_ms = ms(self.import_end, self.first_output)
            t.prefetched = self.prefetched
            if self.stats is not None:
                t.transfer_bytes, t.transfer_seconds = self.stats.num_bytes, self.stats.seconds
        else:
            t.prefill_ms = ms(self.queue_end, self.first_token)
        return t

    def phases(self):
        """(name, start, end, attributes, is_ttft) of each measured phase."""
        out = []
        is_local = self.import_end is None  # prefilled here: these phases lead to the first token
        if self.queue_end is not None:
            out.append(("decode.queue", self.started, self.queue_end, {}, is_local))
        if not is_local:
            out.append(("kv.transfer", self.queue_end, self.import_end, self.transfer_attributes, False))
            if self.first_output is not None:
                out.append(("decode.first_step", self.import_end, self.first_output, {}, False))
        elif self.first_token is not None:
            attrs = {"splitserve.import_failed": self.import_failed}
            out.append(("decode.prefill", self.queue_end, self.first_token, attrs, True))
            if self.first_chunk is not None:
                out.append(("decode.emit", self.first_token, self.first_chunk, {}, True))
        if self.first_chunk is not None and self.last_chunk is not None:
            out.append(("decode.stream", self.first_chunk, self.last_chunk, {}, False))
        return out


def add_decode_service(server: grpc.aio.Server, group: WorkerGroup) -> str:
    decode_worker_pb2_grpc.add_DecodeWorkerServicer_to_server(DecodeWorkerService(group), server)
    return "splitserve.v1.DecodeWorker"
