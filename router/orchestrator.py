"""`Orchestrator`: one request from routing decision to last token (DESIGN.md "One request, disaggregated").

    decide ─▶ PrefillStream(prefill worker) ─▶ first token to the client, then the handoff
                 │ prefill_call.py: retried before the first token; after it, the decode
                 │ worker goes on from prompt + first token (all failed: serve aggregated,
                 │ or fail with enforce_disagg)
                 ▼
           Decode: decode_relay.py (relay, and its retries: same handoff, recompute, resume)

Aggregated requests call Decode without a handoff (the decode worker prefills).
A prefill call has a deadline; a worker that failed UNAVAILABLE or
DEADLINE_EXCEEDED is skipped for a while (suspects.py). Cancellation (client
gone, or Router.Abort) sends Abort to every worker the request touched, so
pinned blocks are freed at once. Admission is a bound on requests in flight:
past it, OverloadedError before any work. All on one event loop; nothing is
shared between router replicas.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

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
    Tokens,
    WorkerCallError,
)
from splitserve.router.policy import (
    DisaggRequiredError,
    NoWorkersError,
    OverloadedError,
    RoutingError,
    route,
)
from splitserve.router.prefill_call import PrefillCaller, PrefillDone
from splitserve.router.request_run import RequestRun
from splitserve.router.request_telemetry import record_finished
from splitserve.telemetry.logs import may_log_prompts
from splitserve.telemetry.metrics import RouterMetrics
from splitserve.telemetry.spans import (
    TTFT_PHASE,
    emit_span,
    mono_to_unix_ns,
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
        """`client` may be any object with GrpcWorkerClient's prefill_stream/decode/abort methods."""
        self._config = config
        self._view = view
        self._client = client
        self.metrics = metrics or RouterMetrics()
        self._running: dict[str, RequestRun] = {}
        self._pending_prefill_tokens = 0
        """Prompt tokens of running requests that have no first token yet (admission model)."""
        self._aborts = AbortSender(client, config.control_timeout_s)
        self._prefill = PrefillCaller(config, view, client, self.metrics, self._aborts)
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
        done, first_sent = PrefillDone(None), False
        if decision.is_disaggregated:
            async with contextlib.aclosing(self._prefill.run(run)) as events:
                async for event in events:
                    if isinstance(event, PrefillDone):
                        done = event
                    else:  # the first token, before its handoff is published
                        run.num_completion_tokens, first_sent = 1, True
                        yield OutputChunk(event)
        if run.is_aborted:
            yield self._last(run, Tokens(), FinishReason.ABORT)
            return
        result = done.result
        if result is not None:
            run.num_cached_tokens = result.num_cached_tokens
            run.num_completion_tokens = 1
            if result.finish_reason is not None:
                if run.prefetch is not None:  # a preview went out, but there is nothing to hand off
                    self._abort_prefetch(run)
                yield self._last(run, Tokens() if first_sent else result.first, result.finish_reason)
                return
            if not first_sent:  # a reply without a first-token event
                yield OutputChunk(result.first)
        async for chunk in self._decode.relay(run, result, done.start_from):
            yield chunk

    def _snapshot(self, run: RequestRun, exclude: frozenset[str] = frozenset()):
        return self._view.snapshot(run.hashes, len(run.request.token_ids), exclude)

    # ---------------------------------------------------------------- helpers
    def _last(self, run: RequestRun, tokens: Tokens, finish_reason: FinishReason) -> OutputChunk:
        return run.last_chunk(tokens, finish_reason, time.monotonic())

    def _abort_prefetch(self, run: RequestRun) -> None:
        """Free the blocks a decode worker reserved for a preview whose handoff never came."""
        worker = run.touched.pop(run.decode_worker_id, None)
        if worker is not None:
            self._aborts.send(worker, run.request.request_id)

    def _abort_workers(self, run: RequestRun) -> None:
        self._aborts.send_all(run.touched.values(), run.request.request_id)


_REJECTION_REASONS = {OverloadedError: "overloaded", NoWorkersError: "no_workers", DisaggRequiredError: "disagg_required"}
