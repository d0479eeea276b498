"""`PrefillCaller`: the Prefill half of a disaggregated request — PrefillStream on a prefill worker, retried.

    PrefillStream(prefill worker) ─▶ first token: to the client at once, before the handoff is published
          │                       └▶ response (handoff descriptor) ─▶ DecodeRelay
          │ failed before the first token: retry on another prefill worker
          │   (all failed: serve aggregated, or RoutingError with enforce_disagg)
          │ failed after the first token, before the response: not retried — the token is out, and
          │   a retry could sample another one — so the worker's request is aborted and the decode
          │   worker computes prompt + first token itself (aggregated, one token less to generate)

Layer-wise streaming: a worker that streams the handoff first sends its preview, as the forward
pass completing the prompt starts; it goes at once to the chosen decode worker's Prefetch (a
background task the Decode call waits for), so the KV moves while prefill still computes.
A first token that already ends the request (its event carries the finish reason) is held until
the response and sent with it, so a failure in between is retried like one before any token.
A request error (INVALID_ARGUMENT, OUT_OF_RANGE) propagates. Each call has a deadline, a worker
that failed UNAVAILABLE or DEADLINE_EXCEEDED becomes a suspect (suspects.py). Owned by the
Orchestrator; one event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from splitserve.router.aborts import AbortSender
from splitserve.router.cluster_view import ClusterView
from splitserve.router.config import RouterConfig
from splitserve.router.messages import (
    FinishReason,
    GenerateRequest,
    PrefillFirstToken,
    PrefillHandoffStarted,
    PrefillResult,
    Tokens,
    WorkerCallError,
)
from splitserve.router.policy import RoutingError, choose_prefill
from splitserve.router.request_run import RequestRun, continuation
from splitserve.router.suspects import note_failure
from splitserve.telemetry.metrics import RouterMetrics
from splitserve.telemetry.spans import FIRST_MESSAGE, attached, mark_error, start_client_span

if TYPE_CHECKING:  # worker_client imports service.py, which imports the orchestrator
    from splitserve.router.worker_client import GrpcWorkerClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillDone:
    """How the Prefill half ended: what the Decode half starts from."""

    result: PrefillResult | None
    """The worker's reply (a handoff, or a finish reason); None: the decode worker computes the prompt."""
    start_from: GenerateRequest | None = None
    """After a failure past the first token: the continuation (prompt + first token) to decode from."""


class PrefillCaller:
    """Runs the Prefill half of requests for the Orchestrator (which owns the collaborators)."""

    def __init__(
        self, config: RouterConfig, view: ClusterView, client: GrpcWorkerClient, metrics: RouterMetrics,
        aborts: AbortSender,
    ) -> None:  # fmt: skip
        self._config = config
        self._view = view
        self._client = client
        self.metrics = metrics
        self._aborts = aborts

    async def run(self, run: RequestRun) -> AsyncIterator[Tokens | PrefillDone]:
        """Yields the first token when it is to be sent at once (at most once), then one PrefillDone.
        Raises RoutingError (every attempt failed under enforce_disagg) or a request's WorkerCallError."""
        failed: set[str] = set()
        while (
            run.prefill_worker_id is not None and run.num_prefill_attempts < self._config.max_prefill_attempts
        ):
            worker = self._view.worker(run.prefill_worker_id)
            run.num_prefill_attempts += 1
            started = time.monotonic()
            first_at: float | None = None
            sent: Tokens | None = None
            """The first token, once handed to the caller: from then on this attempt cannot be retried."""
            span, ctx = start_client_span("router.prefill", {
                "splitserve.worker": run.prefill_worker_id, "splitserve.attempt": run.num_prefill_attempts,
                "splitserve.cache.predicted_tokens": run.predicted_cached_tokens,
            })  # fmt: skip
            try:
                if worker is None:
                    raise WorkerCallError(
                        run.prefill_worker_id,
                        "PrefillStream",
                        grpc.StatusCode.UNAVAILABLE,
                        "left the topology",
                    )
                run.touched[worker.worker_id] = worker
                with attached(ctx):  # the call carries the span's trace context; not held across yields
                    decode = self._view.worker(run.decode_worker_id) if run.decode_worker_id else None
                    call = self._client.prefill_stream(
                        worker, run.request, run.decode_worker_id, self._config.prefill_timeout_s,
                        decode_tp=decode.tp if decode is not None else 0,
                    )
                result = None
                try:
                    with self._view.load.track(worker.worker_id):
                        async for event in call:
                            if isinstance(event, PrefillHandoffStarted):
                                span.add_event("handoff_started")
                                self._prefetch(run, event.preview)
                            elif isinstance(event, PrefillFirstToken):
                                first_at = run.first_token_in_hand_at = time.monotonic()
                                span.add_event(FIRST_MESSAGE)
                                run.prefill_call_ms = (first_at - started) * 1e3
                                if event.finish_reason is None:  # else it goes out with the response
                                    sent = event.first
                                    yield sent
                            else:
                                result = event
                finally:
                    call.cancel()  # a no-op once the stream ended
                if first_at is None:  # a unary-like reply without a first-token event
                    first_at = run.first_token_in_hand_at = time.monotonic()
                    run.prefill_call_ms = (first_at - started) * 1e3
                run.prefill_timing = result.timing
                span.set_attribute("splitserve.cache.actual_tokens", result.num_cached_tokens)
                run.touched[worker.worker_id] = worker  # again: an Abort during the call cleared it
                self._view.record_routed(worker.worker_id, run.hashes)
                done = PrefillDone(result)
            except WorkerCallError as e:
                mark_error(span, e)
                if run.is_aborted:
                    done = PrefillDone(None)
                elif e.is_request_error:
                    raise
                else:
                    done = self._failed(run, worker, e, sent, failed)
            finally:
                now = time.monotonic()
                run.prefill_ms += (now - started) * 1e3
                if first_at is None:
                    run.prefill_failed_ms += (now - started) * 1e3
                span.end()
            if done is not None:
                yield done
                return
        if self._enforce_disagg(run):
            raise RoutingError(f"every prefill attempt failed and enforce_disagg is set ({run.reason})")
        run.prefill_worker_id = None
        run.num_transfer_blocks = 0
        run.reason += "; serving aggregated"
        yield PrefillDone(None)

    def _prefetch(self, run: RequestRun, preview: bytes) -> None:
        """Hand the preview to the decode worker (a background task; Decode awaits it)."""
        worker = self._view.worker(run.decode_worker_id)
        if worker is None or run.is_aborted:
            return
        run.touched[worker.worker_id] = worker  # it reserves blocks: an Abort must reach it
        if run.prefetch is not None:
            run.prefetch.cancel()
        run.prefetch_failure = None  # an earlier attempt's: this preview's Prefetch answers for itself

        async def call() -> None:
            try:
                accepted, reason = await self._client.prefetch(worker, run.request, preview, self._config.control_timeout_s)
            except WorkerCallError as e:  # advisory, but a worker that does not answer would not decode either
                log.info("prefetch of %s on %s failed: %s", run.request.request_id, worker.worker_id, e)
                if e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    run.prefetch_failure = e
                return
            self.metrics.prefetches.labels("accepted" if accepted else "declined").inc()
            if accepted and run.is_aborted:  # taken up after the request's Abort reached the worker
                self._aborts.send(worker, run.request.request_id)
            if not accepted:
                log.info("prefetch of %s declined by %s: %s", run.request.request_id, worker.worker_id, reason)

        run.prefetch = asyncio.create_task(call(), name=f"prefetch-{run.request.request_id}")

    def _failed(
        self, run: RequestRun, worker, error: WorkerCallError, sent: Tokens | None, failed: set[str]
    ) -> PrefillDone | None:
        """After a failed attempt: how the request goes on (None: try the next prefill worker)."""
        note_failure(self._view.suspects, error)
        if worker is not None:
            self._aborts.send(worker, run.request.request_id)  # it may have pinned blocks
            run.touched.pop(worker.worker_id, None)
        if sent is not None:  # the token is out: go on from it, aggregated
            log.warning("request %s: %s after its first token; decoding from prompt + first token",
                        run.request.request_id, error)  # fmt: skip
            self.metrics.retries.labels("prefill_continuation").inc()
            run.num_transfer_blocks = 0
            run.reason += f"; prefill on {error.worker_id} failed after its first token ({error.code.name})"
            if run.request.sampling_params.num_tokens_to_generate <= 1:  # the worker should have said so
                return PrefillDone(PrefillResult(sent, run.num_cached_tokens, FinishReason.LENGTH, b""))
            run.reason += ", recomputing prompt + first token on the decode worker"
            return PrefillDone(None, continuation(run.request, sent))
        log.warning("request %s: %s; retrying prefill elsewhere", run.request.request_id, error)
        self.metrics.retries.labels("prefill").inc()
        failed.add(error.worker_id)
        snapshot = self._view.snapshot(run.hashes, len(run.request.token_ids), frozenset(failed))
        pick = choose_prefill(snapshot, self._config.policy)
        run.prefill_worker_id = pick.worker_id if pick else None
        run.reason += f"; prefill on {error.worker_id} failed ({error.code.name})"
        return None

    def _enforce_disagg(self, run: RequestRun) -> bool:
        override = run.request.enforce_disagg
        return self._config.policy.enforce_disagg if override is None else override
