"""`Orchestrator`: one request from routing decision to last token (DESIGN.md "One request, disaggregated").

    decide ─▶ Prefill(prefill worker) ─▶ first token to the client
                 │ failed before the handoff: retry on another prefill worker
                 │ (all failed: serve aggregated, or fail with enforce_disagg)
                 ▼
           Decode: decode_relay.py (relay, and its retries: same handoff, recompute, resume)

Aggregated requests call Decode without a handoff (the decode worker prefills).
A Prefill call has a deadline; a worker that failed UNAVAILABLE or
DEADLINE_EXCEEDED is skipped for a while (suspects.py). Cancellation (client
gone, or Router.Abort) sends Abort to every worker the request touched, so
pinned blocks are freed at once. Admission is a bound on requests in flight:
past it, OverloadedError before any work. All on one event loop; nothing is
shared between router replicas.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
from opentelemetry import trace

from splitserve.engine.block_hash import hash_blocks
from splitserve.router.aborts import AbortSender
from splitserve.router.admission import check_ttft_slo
from splitserve.router.cluster_view import ClusterView
from splitserve.router.config import RouterConfig
from splitserve.router.decode_relay import DecodeRelay
from splitserve.router.messages import (
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
    choose_prefill,
    route,
)
from splitserve.router.request_run import RequestRun
from splitserve.router.request_telemetry import record_finished
from splitserve.router.suspects import note_failure
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
        self._aborts = AbortSender(client, config.control_timeout_s)
        self._decode = DecodeRelay(config, view, client, self.metrics, self._aborts)

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
                run.sent_token_ids.extend(chunk.tokens.token_ids)
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
            record_finished(m, span, run, outcome)

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
        await self._aborts.wait()

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
        async for chunk in self._decode.relay(run, result):
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
                note_failure(self._view.suspects, e)
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

    # ---------------------------------------------------------------- helpers
    def _enforce_disagg(self, run: RequestRun) -> bool:
        override = run.request.enforce_disagg
        return self._config.policy.enforce_disagg if override is None else override

    def _last(self, run: RequestRun, tokens: Tokens, finish_reason: FinishReason) -> OutputChunk:
        return run.last_chunk(tokens, finish_reason, time.monotonic())

    def _abort_workers(self, run: RequestRun) -> None:
        self._aborts.send_all(run.touched.values(), run.request.request_id)

    def _abort_worker(self, worker: WorkerEndpoint, request_id: str) -> None:
        self._aborts.send(worker, request_id)


_REJECTION_REASONS = {OverloadedError: "overloaded", NoWorkersError: "no_workers", DisaggRequiredError: "disagg_required"}
