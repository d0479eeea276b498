"""`Orchestrator`: one request from routing decision to last token (DESIGN.md "One request, disaggregated").

    decide ─▶ Prefill(prefill worker) ─▶ first token to the client
                 │ failed before the handoff: retry on another prefill worker
                 │ (all failed: serve aggregated, or fail with enforce_disagg)
                 ▼
           Decode(decode worker, handoff) ─▶ relay tokens (the echoed first token is dropped)
                 │ failed before its first chunk: retry on another decode worker, with the
                 │ same handoff if the worker was unreachable and the pin is still leased,
                 │ else recomputed there: prompt + first token, one token less to generate

Aggregated requests call Decode without a handoff (the decode worker
prefills). Cancellation (client gone, or Router.Abort) sends Abort to every
worker the request touched, so pinned blocks are freed at once. Admission is
a bound on requests in flight: past it, OverloadedError before any work.
All on one event loop; nothing is shared between router replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from opentelemetry import trace

from splitserve.engine.block_hash import hash_blocks
from splitserve.router.admission import check_ttft_slo
from splitserve.router.cluster_view import ClusterView
from splitserve.router.config import RouterConfig
from splitserve.router.messages import (
    DecodeTiming,
    FinishReason,
    GenerateRequest,
    OutputChunk,
    PrefillResult,
    Tokens,
    WorkerCallError,
)
from splitserve.router.policy import (
    DisaggRequiredError,
    NoWorkersError,
    OverloadedError,
    RoutingError,
    choose_decode,
    choose_prefill,
    route,
)
from splitserve.router.request_run import RequestRun, continuation, is_handoff_reusable
from splitserve.router.workers import WorkerEndpoint
from splitserve.telemetry.logs import may_log_prompts
from splitserve.telemetry.metrics import RouterMetrics
from splitserve.telemetry.spans import (
    FIRST_MESSAGE,
    TTFT_PHASE,
    attached,
    emit_span,
    mark_error,
    mono_to_unix_ns,
    start_client_span,
    trace_id_hex,
)
from splitserve.telemetry.tracing import tracer

if TYPE_CHECKING:  # worker_client imports service.py, which imports this module
    from splitserve.router.worker_client import GrpcWorkerClient

log = logging.getLogger(__name__)


class DuplicateRequestError(ValueError):
    """A request with this id is already running on this router."""


class Orchestrator:
    """Runs Generate requests against the workers of a ClusterView."""

    def __init__(
        self, config: RouterConfig, view: ClusterView, client: GrpcWorkerClient, metrics: RouterMetrics | None = None
    ) -> None:
        """`client` may be any object with GrpcWorkerClient's prefill/decode/abort methods."""
        self._config = config
        self._view = view
        self._client = client
        self.metrics = metrics or RouterMetrics()
        self._running: dict[str, RequestRun] = {}
        self._pending_prefill_tokens = 0
        """Prompt tokens of running requests that have no first token yet (admission model)."""
        self._background: set[asyncio.Task] = set()

    @property
    def num_in_flight(self) -> int:
        return len(self._running)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[OutputChunk]:
        """Streams the request's output; raises RoutingError subclasses, WorkerCallError or DuplicateRequestError."""
        m = self.metrics
        if request.request_id in self._running:
            m.rejections.labels("duplicate_request_id").inc()
            raise DuplicateRequestError(f"request {request.request_id!r} is already running")
        if len(self._running) >= self._config.max_in_flight:
            m.rejections.labels("max_in_flight").inc()
            raise OverloadedError(f"{len(self._running)} requests in flight (max_in_flight={self._config.max_in_flight})")
        self._admit_by_ttft(len(request.token_ids))
        span = trace.get_current_span()  # Router.Generate's server span (service.py)
        run = self._running[request.request_id] = RequestRun(request, time.monotonic(), trace_id=trace_id_hex(span))
        m.in_flight.inc()
        m.prompt_tokens.inc(len(request.token_ids))
        if log.isEnabledFor(logging.DEBUG):  # prompts stay out of logs unless SPLITSERVE_LOG_PROMPTS=1
            shown = f": {list(request.token_ids)}" if may_log_prompts() else ""
            log.debug("request %s: %d prompt tokens%s", request.request_id, len(request.token_ids), shown)
        outcome, last_token_at = "cancelled", None
        self._pending_prefill_tokens += len(request.token_ids)
        prefill_pending = True
        try:
            async for chunk in self._generate(run):
                if chunk.finish_reason is not None:
                    run.is_finished = True
                    outcome = chunk.finish_reason.value
                num_tokens = len(chunk.tokens.token_ids)
                now = time.monotonic()
                if num_tokens and run.first_token_at is None:
                    run.first_token_at = now
                    self._pending_prefill_tokens -= len(request.token_ids)
                    prefill_pending = False
                    if run.first_token_in_hand_at is not None:  # the relay: reply in hand -> token out
                        emit_span("router.first_token", mono_to_unix_ns(run.first_token_in_hand_at),
                                  mono_to_unix_ns(now), is_ttft_phase=True)  # fmt: skip
                elif num_tokens and last_token_at is not None:
                    m.itl_seconds.observe((now - last_token_at) / num_tokens)
                last_token_at = now if num_tokens else last_token_at
                yield chunk
                if num_tokens and run.first_token_sent_at is None:
                    run.first_token_sent_at = time.monotonic()
                    m.ttft_seconds.observe(run.ttft_s)
        except (OverloadedError, NoWorkersError, DisaggRequiredError) as e:
            outcome = "rejected"
            m.rejections.labels(_REJECTION_REASONS.get(type(e), type(e).__name__)).inc()
            raise
        except (RoutingError, WorkerCallError) as e:
            outcome = "error"
            span.record_exception(e)
            raise
        finally:
            if prefill_pending:
                self._pending_prefill_tokens -= len(request.token_ids)
            del self._running[request.request_id]
            if not run.is_finished or run.is_aborted:  # cancelled, failed or abandoned: free what workers hold
                self._abort_workers(run)
            m.in_flight.dec()
            m.requests.labels(outcome).inc()
            m.cached_tokens.inc(run.num_cached_tokens)
            if run.decode_timing is not None:
                m.transfer_bytes.inc(run.decode_timing.transfer_bytes)
            span.set_attributes({
                "splitserve.request_id": request.request_id, "splitserve.outcome": outcome,
                "splitserve.prompt_tokens": len(request.token_ids), "splitserve.completion_tokens": run.num_completion_tokens,
                "splitserve.cache.predicted_tokens": run.predicted_cached_tokens,
                "splitserve.cache.actual_tokens": run.num_cached_tokens,
                "splitserve.prefill_worker": run.prefill_worker_id or "", "splitserve.decode_worker": run.decode_worker_id,
                "splitserve.num_prefill_attempts": run.num_prefill_attempts,
                "splitserve.num_decode_attempts": run.num_decode_attempts,
            })  # fmt: skip

    def _admit_by_ttft(self, num_prompt_tokens: int) -> None:
        try:
            check_ttft_slo(
                self._config.ttft_slo_s, (w.role for w in self._view.workers.values()),
                self._pending_prefill_tokens, num_prompt_tokens, self._config.prefill_tokens_per_s,
            )  # fmt: skip
        except OverloadedError:
            self.metrics.rejections.labels("ttft_slo").inc()
            raise

    async def abort(self, request_id: str) -> bool:
        """Aborts a running request on its workers; its stream ends with FinishReason.ABORT."""
        run = self._running.get(request_id)
        if run is None:
            return False
        run.is_aborted = True
        self._abort_workers(run)
        run.touched.clear()  # a worker touched from now on (a racing prefill) is aborted when the stream ends
        return True

    async def close(self) -> None:
        """Waits (briefly) for the Abort calls still in the background."""
        if self._background:
            await asyncio.wait(self._background, timeout=self._config.control_timeout_s)

    # ------------------------------------------------------------------- flow
    async def _generate(self, run: RequestRun) -> AsyncIterator[OutputChunk]:
        request = run.request
        started = time.monotonic()
        policy = self._config.policy.policy
        with tracer().start_as_current_span("router.route", attributes={TTFT_PHASE: True, "splitserve.policy": policy}) as span:
            run.hashes = hash_blocks(request.token_ids, self._view.block_size)
            decision = route(self._snapshot(run), self._config.policy, request.enforce_disagg)
            span.set_attributes({
                "splitserve.disaggregated": decision.is_disaggregated,
                "splitserve.prefill_worker": decision.prefill_worker_id or "",
                "splitserve.decode_worker": decision.decode_worker_id,
                "splitserve.cache.predicted_tokens": decision.num_predicted_cached_tokens,
                "splitserve.transfer_blocks": decision.num_transfer_blocks, "splitserve.reason": decision.reason,
            })  # fmt: skip
        run.route_ms = (time.monotonic() - started) * 1e3
        self.metrics.route_seconds.observe(run.route_ms / 1e3)
        self.metrics.decisions.labels(policy, "disaggregated" if decision.is_disaggregated else "aggregated").inc()
        self.metrics.predicted_cached_tokens.inc(decision.num_predicted_cached_tokens)
        run.prefill_worker_id, run.decode_worker_id = decision.prefill_worker_id, decision.decode_worker_id
        run.predicted_cached_tokens, run.reason = decision.num_predicted_cached_tokens, decision.reason
        run.num_transfer_blocks = decision.num_transfer_blocks
        result = await self._prefill(run) if decision.is_disaggregated else None
        if run.is_aborted:
            yield self._last(run, Tokens(), FinishReason.ABORT)
            return
        if result is not None:
            run.num_cached_tokens = result.num_cached_tokens
            run.num_completion_tokens = 1
            if result.finish_reason is not None:
                yield self._last(run, result.first, result.finish_reason)
                return
            yield OutputChunk(result.first)
        async for chunk in self._decode(run, result):
            yield chunk

    def _snapshot(self, run: RequestRun, exclude: frozenset[str] = frozenset()):
        return self._view.snapshot(run.hashes, len(run.request.token_ids), exclude)

    async def _prefill(self, run: RequestRun) -> PrefillResult | None:
        """The prefill result, or None when every attempt failed and aggregated serving is allowed."""
        failed: set[str] = set()
        while run.prefill_worker_id is not None and run.num_prefill_attempts < self._config.max_prefill_attempts:
            worker = self._view.worker(run.prefill_worker_id)
            run.num_prefill_attempts += 1
            started = time.monotonic()
            span, ctx = start_client_span("router.prefill", {
                "splitserve.worker": run.prefill_worker_id, "splitserve.attempt": run.num_prefill_attempts,
                "splitserve.cache.predicted_tokens": run.predicted_cached_tokens,
            })  # fmt: skip
            try:
                if worker is None:
                    raise WorkerCallError(run.prefill_worker_id, "Prefill", grpc.StatusCode.UNAVAILABLE, "left the topology")
                run.touched[worker.worker_id] = worker
                with self._view.load.track(worker.worker_id), attached(ctx):
                    result = await self._client.prefill(worker, run.request, run.decode_worker_id, self._config.prefill_timeout_s)
                run.first_token_in_hand_at = time.monotonic()
                span.add_event(FIRST_MESSAGE)
                run.prefill_call_ms = (run.first_token_in_hand_at - started) * 1e3
                run.prefill_timing = result.timing
                span.set_attribute("splitserve.cache.actual_tokens", result.num_cached_tokens)
                run.touched[worker.worker_id] = worker  # again: an Abort during the call cleared it
                self._view.record_routed(worker.worker_id, run.hashes)
                return result
            except WorkerCallError as e:
                mark_error(span, e)
                if run.is_aborted:
                    return None
                if e.is_request_error:
                    raise
                log.warning("request %s: %s; retrying prefill elsewhere", run.request.request_id, e)
                self.metrics.retries.labels("prefill").inc()
                failed.add(e.worker_id)
                if worker is not None:
                    self._abort_worker(worker, run.request.request_id)  # it may have pinned blocks
                    run.touched.pop(worker.worker_id, None)
                pick = choose_prefill(self._snapshot(run, frozenset(failed)), self._config.policy)
                run.prefill_worker_id = pick.worker_id if pick else None
                run.reason += f"; prefill on {e.worker_id} failed ({e.code.name})"
            finally:
                run.prefill_ms += (time.monotonic() - started) * 1e3
                span.end()
        if self._enforce_disagg(run):
            raise RoutingError(f"every prefill attempt failed and enforce_disagg is set ({run.reason})")
        run.prefill_worker_id = None
        run.num_transfer_blocks = 0
        run.reason += "; serving aggregated"
        return None

    async def _decode(self, run: RequestRun, prefill: PrefillResult | None) -> AsyncIterator[OutputChunk]:
        request, handoff = run.request, prefill.handoff if prefill else None
        prefill_worker = self._view.worker(run.prefill_worker_id) if run.prefill_worker_id else None
        failed: set[str] = set()
        while True:
            worker = self._view.worker(run.decode_worker_id)
            run.num_decode_attempts += 1
            has_output = False
            span, ctx = start_client_span("router.decode", {
                "splitserve.worker": run.decode_worker_id, "splitserve.attempt": run.num_decode_attempts,
                "splitserve.handoff": handoff is not None,
            })  # fmt: skip
            try:
                if worker is None:
                    raise WorkerCallError(run.decode_worker_id, "Decode", grpc.StatusCode.UNAVAILABLE, "left the topology")
                run.touched[worker.worker_id] = worker
                if handoff is None:
                    self._view.record_routed(worker.worker_id, run.hashes)
                started = time.monotonic()
                with attached(ctx):
                    call = self._client.decode(
                        worker, request, handoff, prefill_worker.address if handoff and prefill_worker else None,
                        self._config.decode_timeout_s,
                    )  # fmt: skip
                needs_strip = handoff is not None
                is_first = True
                with self._view.load.track(worker.worker_id), contextlib.closing(_Closer(call.cancel)):
                    async for output in call:
                        if is_first:
                            is_first = False
                            span.add_event(FIRST_MESSAGE)
                            run.decode_first_chunk_ms = (time.monotonic() - started) * 1e3
                            if prefill is None:
                                run.first_token_in_hand_at = time.monotonic()
                        if output.timing is not None:
                            run.decode_timing = output.timing
                            _transfer_attributes(span, output.timing)
                        tokens = output.tokens
                        if needs_strip and tokens.token_ids:
                            tokens, needs_strip = tokens.drop_first(), False  # the prefill's token, already sent
                            self._view.record_routed(worker.worker_id, run.hashes)
                        if prefill is None and output.num_cached_tokens:
                            run.num_cached_tokens = output.num_cached_tokens
                        run.num_completion_tokens += len(tokens.token_ids)
                        if output.finish_reason is not None:
                            yield self._last(run, tokens, output.finish_reason)
                            return
                        if tokens.token_ids:
                            has_output = True
                            yield OutputChunk(tokens)
                raise WorkerCallError(worker.worker_id, "Decode", grpc.StatusCode.INTERNAL, "stream ended without a finish reason")
            except WorkerCallError as e:
                mark_error(span, e)
                if has_output or e.is_request_error:
                    raise
                if run.is_aborted:
                    yield self._last(run, Tokens(), FinishReason.ABORT)
                    return
                log.warning("request %s: %s; retrying decode elsewhere", request.request_id, e)
                self.metrics.retries.labels("decode").inc()
                failed.add(e.worker_id)
                if worker is not None:
                    self._abort_worker(worker, request.request_id)
                    run.touched.pop(worker.worker_id, None)
                pick = choose_decode(self._snapshot(run, frozenset(failed)), self._config.policy.transfer_weight)
                if pick is None or run.num_decode_attempts >= self._config.max_decode_attempts:
                    raise
                run.decode_worker_id = pick.worker_id
                run.reason += f"; decode on {e.worker_id} failed ({e.code.name})"
                if handoff is not None and not is_handoff_reusable(e.code, prefill.lease_deadline_unix_ms, time.time() * 1e3):
                    if request.sampling_params.num_tokens_to_generate <= 1:
                        yield self._last(run, Tokens(), FinishReason.LENGTH)
                        return
                    request, handoff = self._continuation(run, prefill), None
                    run.reason += ", recomputing on the next decode worker"
            finally:
                span.end()

    # ---------------------------------------------------------------- helpers
    def _enforce_disagg(self, run: RequestRun) -> bool:
        override = run.request.enforce_disagg
        return self._config.policy.enforce_disagg if override is None else override

    def _continuation(self, run: RequestRun, prefill: PrefillResult) -> GenerateRequest:
        """Recompute on the next decode worker: the pinned copy will not be pulled, so unpin it."""
        prefill_worker = run.touched.pop(run.prefill_worker_id, None) if run.prefill_worker_id else None
        if prefill_worker is not None:
            self._abort_worker(prefill_worker, run.request.request_id)
        return continuation(run.request, prefill.first)

    def _last(self, run: RequestRun, tokens: Tokens, finish_reason: FinishReason) -> OutputChunk:
        return run.last_chunk(tokens, finish_reason, time.monotonic())

    def _abort_workers(self, run: RequestRun) -> None:
        for worker in run.touched.values():
            self._abort_worker(worker, run.request.request_id)

    def _abort_worker(self, worker: WorkerEndpoint, request_id: str) -> None:
        """Sends Abort in the background: it must survive the cancellation of the request's task."""

        async def call() -> None:
            try:
                await self._client.abort(worker, request_id, self._config.control_timeout_s)
            except WorkerCallError as e:
                log.info("Abort of %s on %s failed: %s", request_id, worker.worker_id, e)

        task = asyncio.create_task(call(), name=f"abort-{request_id}-{worker.worker_id}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)


_REJECTION_REASONS = {OverloadedError: "overloaded", NoWorkersError: "no_workers", DisaggRequiredError: "disagg_required"}


def _transfer_attributes(span, timing: DecodeTiming) -> None:
    """The decode worker's measured KV transfer, on the router's Decode span too."""
    if timing.transport:
        span.set_attributes({
            "splitserve.kv.bytes": timing.transfer_bytes, "splitserve.kv.seconds": timing.transfer_seconds,
            "splitserve.kv.transport": timing.transport,
        })  # fmt: skip


@dataclass(frozen=True)
class _Closer:
    """Cancels a decode call when its block is left, early (client gone, error) or not (a no-op then)."""

    close: Callable[[], None]
