"""`splitserve.v1.PrefillWorker` over gRPC (asyncio) — the only proto ↔ dataclass
conversion of the prefill worker (shared message conversion lives in engine/wire.py).

Prefill and PrefillStream share one path (`_serve` → `_prefill`); the stream only
also sends the first token the moment the engine thread hands it over (hooks.py), before
the handoff is published, so the caller's time to first token excludes the publication.

Errors map to status codes, never to tracebacks: bad input → INVALID_ARGUMENT,
a full pinned-KV budget → RESOURCE_EXHAUSTED (retry elsewhere / later), a
stopped engine → UNAVAILABLE, no first token / reply within the worker's own
timeout → DEADLINE_EXCEEDED. A cancelled call (or a stream closed before its
response) aborts the request on every rank.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
import uuid

import grpc

from splitserve.engine import fault_injection
from splitserve.engine.handoff import HandoffDescriptor
from splitserve.engine.handoff_push import PushGrant, PushRequest
from splitserve.engine.serving import Command
from splitserve.engine.transfer.layout import layout_text
from splitserve.engine.wire import (
    FINISH_REASONS,
    descriptor_to_proto,
    finish_reason,
    grant_to_proto,
    prompt_logprobs_to_proto,
    push_from_proto,
    sampling_from_proto,
    top_logprobs_to_proto,
)
from splitserve.engine.worker_integrity import integrity_to_proto
from splitserve.engine.worker_runtime import WorkerGroup
from splitserve.engine.worker_server import unavailable_when_stopped
from splitserve.prefill_worker.hooks import FirstToken, PrefillOutcome
from splitserve.proto.v1 import common_pb2, prefill_worker_pb2, prefill_worker_pb2_grpc
from splitserve.telemetry.spans import (
    FIRST_MESSAGE,
    attached,
    emit_span,
    mark_error,
    mono_to_unix_ns,
    start_server_span,
)

log = logging.getLogger(__name__)


class PrefillWorkerService(prefill_worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, group: WorkerGroup, max_pinned_fraction: float = 0.5, timeout_s: float = 120.0):
        self.group = group
        self.loop = group.loop
        self.state = group.state
        self.engine = group.engine
        self.max_pinned_blocks = int(max_pinned_fraction * self.engine.pool.num_blocks)
        self.timeout_s = timeout_s
        self.metrics = group.metrics

    async def _submit(self, command: Command):
        return await asyncio.wrap_future(self.loop.submit(command))

    async def Prefill(self, request, context):  # noqa: N802 - gRPC method name
        """The whole prefill in one reply: the first token waits for the publication (PrefillStream does not)."""
        response = None
        async with contextlib.aclosing(self._serve(request, context, is_stream=False)) as messages:
            async for response in messages:  # noqa: B007 - the last message is the reply
                pass
        return response

    async def PrefillStream(self, request, context):  # noqa: N802
        """The first token as soon as it is sampled, then the same response as Prefill."""
        # aclosing: a stream closed early closes `_prefill` now (it aborts the request), not at GC.
        async with contextlib.aclosing(self._serve(request, context, is_stream=True)) as messages:
            async for message in messages:
                if isinstance(message, FirstToken):
                    yield prefill_worker_pb2.PrefillEvent(first_token=_first_token_to_proto(message))
                elif isinstance(message, HandoffDescriptor):
                    yield prefill_worker_pb2.PrefillEvent(handoff_started=descriptor_to_proto(message))
                else:
                    yield prefill_worker_pb2.PrefillEvent(response=message)

    async def _serve(self, request, context, is_stream: bool):
        """Prefill and PrefillStream alike: the span, metrics, drain refusal and in-flight count
        around `_prefill`, whose messages it passes on."""
        started = time.monotonic()
        span, span_context = start_server_span("prefill.request", context.invocation_metadata(), {
            "rpc.system": "grpc", "rpc.service": "splitserve.v1.PrefillWorker",
            "rpc.method": "PrefillStream" if is_stream else "Prefill",
            "splitserve.request_id": request.request_id, "splitserve.prompt_tokens": len(request.token_ids),
        })  # fmt: skip
        outcome = "error"
        with attached(span_context):
            try:
                if self.group.draining:
                    self.metrics.rejections.labels("prefill", "draining").inc()
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill worker is draining; use another")
                self.group.num_in_flight += 1
                try:
                    async with contextlib.aclosing(self._prefill(request, context, started, is_stream)) as messages:
                        async for message in messages:
                            if isinstance(message, HandoffDescriptor):
                                span.add_event("handoff_started", {"splitserve.progress_slot": message.progress_slot})
                            elif isinstance(message, FirstToken):
                                span.add_event(FIRST_MESSAGE)  # the trace report's reply leg starts here
                            else:
                                outcome = "handoff" if message.HasField("handoff") else "finished"
                            yield message
                finally:
                    self.group.num_in_flight -= 1
            except (asyncio.CancelledError, GeneratorExit):
                outcome = "cancelled"
                raise
            except BaseException as exc:
                mark_error(span, exc)
                raise
            finally:
                self.metrics.requests.labels("prefill", outcome).inc()
                span.set_attribute("splitserve.outcome", outcome)
                span.end()

    async def _prefill(self, request, context, started: float, is_stream: bool):
        """Yields the FirstToken once sampled (`is_stream` only), then the PrefillResponse.

        A call that goes away before its response (cancelled, past `timeout_s`, or the
        stream closed after its first token) aborts the request: nobody will pull its pins."""
        request_id = request.request_id or uuid.uuid4().hex
        try:
            params = sampling_from_proto(request.sampling_params)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if self.engine.num_pinned_blocks >= self.max_pinned_blocks:
            self.metrics.rejections.labels("prefill", "pinned_budget_full").inc()
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"pinned KV budget full ({self.engine.num_pinned_blocks} of {self.max_pinned_blocks} blocks); retry",
            )
        if request_id in self.state.waiters:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} is already prefilling")
        first_token: concurrent.futures.Future = concurrent.futures.Future()
        waiter: concurrent.futures.Future = concurrent.futures.Future()
        self.state.first_tokens[request_id] = first_token
        self.state.waiters[request_id] = waiter
        if request.decode_tp > 0:
            self.state.decode_tp[request_id] = request.decode_tp
        preview_future: concurrent.futures.Future | None = None
        if is_stream and self.engine.config.transfer.layerwise:
            preview_future = self.state.started[request_id] = concurrent.futures.Future()
        deadline = started + self.timeout_s
        first_sent = None
        try:
            await self._submit(Command("add", request_id, (list(request.token_ids), params)))
            if preview_future is not None:  # the preview, unless the first token comes first (board full, ...)
                preview = await self._preview(request_id, preview_future, first_token, deadline)
                if preview is not None:
                    yield preview
            if is_stream:
                first = await asyncio.wait_for(asyncio.wrap_future(first_token), deadline - time.monotonic())
                first_sent = time.monotonic()
                yield first
            outcome: PrefillOutcome = await asyncio.wait_for(asyncio.wrap_future(waiter), deadline - time.monotonic())
            if outcome.descriptor is not None:
                await fault_injection.hold("prefill", request_id)
        except ValueError as exc:
            self.state.forget(request_id)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except (asyncio.CancelledError, TimeoutError, GeneratorExit) as exc:
            self.state.forget(request_id)
            self.loop.submit(Command("abort", request_id))  # pinned or not: nobody will pull it
            if isinstance(exc, TimeoutError):
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"prefill of {request_id!r} took over {self.timeout_s:g} s"
                )
            raise
        except RuntimeError as exc:  # the engine loop stopped
            self.state.forget(request_id)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        response = prefill_worker_pb2.PrefillResponse(num_cached_tokens=outcome.result.num_cached_tokens)
        if outcome.descriptor is not None:
            response.handoff.CopyFrom(descriptor_to_proto(outcome.descriptor))
            self.metrics.handoffs.labels("prefill").inc()
        else:
            response.finish_reason = finish_reason(outcome.result)
        response.timing.CopyFrom(self._record_timing(outcome, started, first_sent))
        yield response

    async def _preview(self, request_id: str, started, first_token, deadline: float) -> HandoffDescriptor | None:
        """The streamed handoff's preview once its forward pass starts; None when the first token
        came without one. Raises TimeoutError past `deadline`."""
        waits = [asyncio.wrap_future(started), asyncio.wrap_future(first_token)]
        done, _ = await asyncio.wait(waits, timeout=max(0.0, deadline - time.monotonic()),
                                     return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        if not done:
            raise TimeoutError
        self.state.started.pop(request_id, None)
        if waits[0] in done and not waits[0].cancelled():
            return waits[0].result()
        started.cancel()
        return None

    def _record_timing(
        self, outcome: PrefillOutcome, started: float, first_sent: float | None
    ) -> prefill_worker_pb2.PrefillTiming:
        """Phase spans (children of the current prefill.request span), metrics, and the reply's timing.

        `first_sent`: when PrefillStream handed the first token to gRPC (None: unary Prefill). The
        time to first token then ends there, so the publication is off its path (not a TTFT phase)."""
        result, now = outcome.result, time.monotonic()
        t = result.timing
        scheduled = t.first_scheduled if t and t.first_scheduled is not None else started
        first = t.first_token if t and t.first_token is not None else scheduled
        num_chunks = t.num_prefill_chunks if t else 0
        emit_span("prefill.queue", mono_to_unix_ns(started), mono_to_unix_ns(scheduled), is_ttft_phase=True)
        emit_span("prefill.compute", mono_to_unix_ns(scheduled), mono_to_unix_ns(first), {
            "splitserve.prompt_tokens": result.prompt_length, "splitserve.cached_tokens": result.num_cached_tokens,
            "splitserve.computed_tokens": result.prompt_length - result.num_cached_tokens,
            "splitserve.prefill_chunks": num_chunks,
        }, is_ttft_phase=True)  # fmt: skip
        if first_sent is not None:  # sampled -> handed to gRPC: the engine thread's wake-up of this call
            emit_span("prefill.emit", mono_to_unix_ns(first), mono_to_unix_ns(first_sent), is_ttft_phase=True)
        desc = outcome.descriptor
        publish = {"splitserve.handoff": desc is not None}
        if desc is not None:
            layout = desc.layout
            publish.update({
                "splitserve.kv.transport": desc.transport_kind, "splitserve.kv.blocks": len(desc.block_checksums),
                "splitserve.kv.src_layout": layout_text(layout),
            })  # fmt: skip
        emit_span("handoff.publish", mono_to_unix_ns(first), mono_to_unix_ns(now), publish,
                  is_ttft_phase=first_sent is None)  # fmt: skip
        m = self.metrics
        m.queue_seconds.labels("prefill").observe(scheduled - started)
        m.prefill_seconds.labels("prefill").observe(first - scheduled)
        m.ttft_seconds.labels("prefill").observe(first - started)
        return prefill_worker_pb2.PrefillTiming(
            handler_ms=(now - started) * 1e3, queue_ms=(scheduled - started) * 1e3, compute_ms=(first - scheduled) * 1e3,
            publish_ms=(now - first) * 1e3, num_chunks=num_chunks,
            first_token_ms=0.0 if first_sent is None else (first_sent - started) * 1e3,
        )  # fmt: skip

    async def Release(self, request, context):  # noqa: N802
        was_pinned = await self._submit(Command("release", request.request_id))
        return prefill_worker_pb2.ReleaseResponse(was_pinned=bool(was_pinned))

    @unavailable_when_stopped
    async def Abort(self, request, context):  # noqa: N802
        found = await self._submit(Command("abort", request.request_id))
        self.state.forget(request.request_id)
        return common_pb2.AbortResponse(was_found=bool(found))

    @unavailable_when_stopped
    async def GetBlockSet(self, request, context):  # noqa: N802
        return await self._submit(Command("block_set"))  # a BlockSet built on the engine thread

    @unavailable_when_stopped
    async def CheckIntegrity(self, request, context):  # noqa: N802
        report = await self._submit(Command("integrity"))
        return integrity_to_proto(report, num_in_flight=self.group.num_in_flight, is_draining=self.group.draining)

    async def PushKV(self, request, context):  # noqa: N802
        """torch_dist: answer once the "push" command has decided; it sends afterwards.

        A refusal (FAILED_PRECONDITION, INVALID_ARGUMENT, RESOURCE_EXHAUSTED) guarantees
        nothing is sent. The wait ends before the caller's deadline (0.8 of it) so that a
        busy engine loop is reported as RESOURCE_EXHAUSTED rather than a lost answer.
        """
        if self.state.transport_kind != "torch_dist":
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this prefill worker hands off over {self.state.transport_kind}; PushKV needs --transport torch_dist",
            )
        try:
            push = push_from_proto(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        push_id = uuid.uuid4().hex
        waiter: concurrent.futures.Future = concurrent.futures.Future()
        self.state.push_waiters[push_id] = waiter
        try:
            sent = self.loop.submit(Command("push", push.request_id, (push_id, push)))
            sent.add_done_callback(lambda f: _push_done(push, waiter, f))
            answered = asyncio.wrap_future(waiter)
            await asyncio.wait([answered], timeout=0.8 * push.timeout_s)
            answered.add_done_callback(lambda f: f.cancelled() or f.exception())  # read below, not here
        except asyncio.CancelledError:
            waiter.cancel()
            raise
        finally:
            self.state.push_waiters.pop(push_id, None)
        if waiter.cancel():  # still undecided: the command will now refuse (cancel and decide are exclusive)
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"prefill worker busy: the push was not taken up within {0.8 * push.timeout_s:.1f} s",
            )
        try:
            decision = waiter.result()
        except RuntimeError as exc:  # the engine loop stopped, or the command failed before deciding
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        if not isinstance(decision, PushGrant):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(decision))
        return grant_to_proto(decision)


def _first_token_to_proto(first: FirstToken) -> prefill_worker_pb2.PrefillFirstToken:
    message = prefill_worker_pb2.PrefillFirstToken(
        token_id=first.token_id, top_logprobs=top_logprobs_to_proto(first.top_logprobs).top_logprobs,
        finish_reason=FINISH_REASONS.get(first.finished_as, common_pb2.FINISH_REASON_UNSPECIFIED),
    )  # fmt: skip
    if first.logprob is not None:
        message.logprob = first.logprob
    if (prompt := prompt_logprobs_to_proto(first.result)) is not None:
        message.prompt_logprobs.CopyFrom(prompt)
    return message


def _push_done(push: PushRequest, waiter: concurrent.futures.Future, sent: concurrent.futures.Future) -> None:
    """The "push" command finished (engine thread): log a failed send; wake a caller it never answered."""
    error = sent.exception()
    if error is not None:
        log.warning("push of %s to %s failed: %s", push.request_id, push.decode_worker_id, error)
        if not waiter.done():
            try:
                waiter.set_exception(RuntimeError(f"the push command failed before deciding: {error}"))
            except concurrent.futures.InvalidStateError:
                pass


def add_prefill_service(server: grpc.aio.Server, group: WorkerGroup) -> str:
    prefill_worker_pb2_grpc.add_PrefillWorkerServicer_to_server(PrefillWorkerService(group), server)
    return "splitserve.v1.PrefillWorker"
