"""`DecodeRelay`: the Decode half of one request — call a decode worker, relay its tokens, retry.

    Decode(decode worker, handoff) ─▶ relay tokens (the echoed first token is dropped)
      │ failed before its first token: retry on another decode worker, with the same
      │ handoff if the worker failed unreachable before any chunk and the pin is still
      │ leased, else recomputed there: prompt + first token, one token less to generate
      │ failed after tokens went out: without stop words → resumed on another decode worker
      │ from prompt + every token sent (sampling positions, hence seeds, counted on past them);
      │ with stop words UNAVAILABLE, "retry the request"

Each attempt has deadlines for its first chunk and between chunks (stream_deadlines.py),
and a worker that failed UNAVAILABLE or DEADLINE_EXCEEDED becomes a suspect (suspects.py).
Owned by the Orchestrator; one event loop.
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

from splitserve.router.aborts import AbortSender
from splitserve.router.cluster_view import ClusterView
from splitserve.router.config import RouterConfig
from splitserve.router.messages import (
    FinishReason,
    GenerateRequest,
    OutputChunk,
    PrefillResult,
    Tokens,
    WorkerCallError,
)
from splitserve.router.policy import choose_decode
from splitserve.router.request_run import RequestRun, continuation, is_handoff_reusable
from splitserve.router.request_telemetry import transfer_attributes
from splitserve.router.stream_deadlines import with_deadlines
from splitserve.router.suspects import note_failure
from splitserve.telemetry.metrics import RouterMetrics
from splitserve.telemetry.spans import FIRST_MESSAGE, attached, mark_error, start_client_span

if TYPE_CHECKING:  # worker_client imports service.py, which imports the orchestrator
    from splitserve.router.worker_client import GrpcWorkerClient

log = logging.getLogger(__name__)


class DecodeRelay:
    """Runs the Decode half of requests for the Orchestrator (which owns the collaborators)."""

    def __init__(
        self, config: RouterConfig, view: ClusterView, client: GrpcWorkerClient, metrics: RouterMetrics,
        aborts: AbortSender,
    ) -> None:  # fmt: skip
        self._config = config
        self._view = view
        self._client = client
        self.metrics = metrics
        self._aborts = aborts

    async def relay(
        self, run: RequestRun, prefill: PrefillResult | None, start_from: GenerateRequest | None = None
    ) -> AsyncIterator[OutputChunk]:
        """The decode stream's chunks (`prefill` None: aggregated, the decode worker prefills `start_from`,
        by default the request itself); raises WorkerCallError when no retry can save the request."""
        request, handoff = start_from or run.request, prefill.handoff if prefill else None
        prefill_worker = self._view.worker(run.prefill_worker_id) if run.prefill_worker_id else None
        if run.prefetch is not None:  # the decode worker must see the prefetch before the import
            done, _ = await asyncio.wait([run.prefetch], timeout=self._config.control_timeout_s)
            if not done and run.prefetch_failure is None:
                run.prefetch_failure = WorkerCallError(run.decode_worker_id, "Prefetch", grpc.StatusCode.DEADLINE_EXCEEDED,
                                                       f"no answer within {self._config.control_timeout_s:g} s")  # fmt: skip
            if run.is_aborted:  # aborted meanwhile: its Abort may have reached the decode worker already
                yield _last(run, Tokens(), FinishReason.ABORT)
                return
        unanswered = run.prefetch_failure  # the Prefetch to the chosen worker got no answer
        failed: set[str] = set()
        while True:
            worker = self._view.worker(run.decode_worker_id)
            run.num_decode_attempts += 1
            has_output = False
            has_chunk = False
            """A chunk came: the worker pulled (and released) the handoff, so a retry must recompute."""
            span, ctx = start_client_span("router.decode", {
                "splitserve.worker": run.decode_worker_id, "splitserve.attempt": run.num_decode_attempts,
                "splitserve.handoff": handoff is not None,
            })  # fmt: skip
            try:
                if worker is None:
                    raise WorkerCallError(run.decode_worker_id, "Decode", grpc.StatusCode.UNAVAILABLE, "left the topology")
                run.touched[worker.worker_id] = worker
                if unanswered is not None and unanswered.worker_id == worker.worker_id:
                    raise unanswered
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
                timeouts = self._config.decode_first_chunk_timeout_s, self._config.decode_stall_timeout_s
                with self._view.load.track(worker.worker_id), contextlib.closing(_Closer(call.cancel)):
                    async for output in with_deadlines(call, worker.worker_id, *timeouts):
                        if is_first:
                            is_first, has_chunk = False, True
                            span.add_event(FIRST_MESSAGE)
                            run.decode_first_chunk_ms = (time.monotonic() - started) * 1e3
                            if run.first_token_in_hand_at is None:  # aggregated: this is the first token
                                run.first_token_in_hand_at = time.monotonic()
                        if output.timing is not None:
                            run.decode_timing = output.timing
                            transfer_attributes(span, output.timing)
                        tokens = output.tokens
                        if needs_strip and tokens.token_ids:
                            tokens, needs_strip = tokens.drop_first(), False  # the prefill's token, already sent
                            self._view.record_routed(worker.worker_id, run.hashes)
                        if prefill is None and output.num_cached_tokens and request is run.request:  # not resumed
                            run.num_cached_tokens = output.num_cached_tokens
                        run.num_completion_tokens += len(tokens.token_ids)
                        if output.finish_reason is not None:
                            yield _last(run, tokens, output.finish_reason)
                            return
                        if tokens.token_ids:
                            has_output = True
                            yield OutputChunk(tokens)
                raise WorkerCallError(worker.worker_id, "Decode", grpc.StatusCode.INTERNAL, "stream ended without a finish reason")
            except WorkerCallError as e:
                mark_error(span, e)
                if e.is_request_error:
                    raise
                note_failure(self._view.suspects, e)
                if run.is_aborted:
                    yield _last(run, Tokens(), FinishReason.ABORT)
                    return
                log.warning("request %s: %s; retrying decode elsewhere", request.request_id, e)
                self.metrics.retries.labels("decode").inc()
                failed.add(e.worker_id)
                if worker is not None:
                    self._aborts.send(worker, request.request_id)
                    run.touched.pop(worker.worker_id, None)
                pick = choose_decode(self._view.snapshot(run.hashes, len(run.request.token_ids), frozenset(failed)), self._config.policy.transfer_weight)
                if pick is None or run.num_decode_attempts >= self._config.max_decode_attempts:
                    if has_output:
                        raise _broken_stream(e, run, "and no other decode worker could go on with it") from e
                    raise
                run.decode_worker_id = pick.worker_id
                run.reason += f"; decode on {e.worker_id} failed ({e.code.name})"
                if has_output:  # go on from what was sent, recomputed on the next worker
                    sent = Tokens(tuple(run.sent_token_ids))
                    if len(sent.token_ids) >= run.request.sampling_params.num_tokens_to_generate:
                        yield _last(run, Tokens(), FinishReason.LENGTH)
                        return
                    request, handoff = continuation(run.request, sent), None
                    run.reason += f", resumed after {len(sent.token_ids)} tokens on the next decode worker"
                elif handoff is not None and (has_chunk or not self._is_reusable(e, unanswered, prefill)):
                    if request.sampling_params.num_tokens_to_generate <= 1:
                        yield _last(run, Tokens(), FinishReason.LENGTH)
                        return
                    request, handoff = self._continuation(run, prefill), None
                    run.reason += ", recomputing on the next decode worker"
            finally:
                span.end()

    @staticmethod
    def _is_reusable(error: WorkerCallError, unanswered: WorkerCallError | None, prefill: PrefillResult) -> bool:
        """May the next worker pull the pinned copy? A failed Prefetch only read it (the pin is released
        on a Decode's acknowledgement), so it is reusable while its lease lasts, whatever the code."""
        code = grpc.StatusCode.UNAVAILABLE if error is unanswered else error.code
        return is_handoff_reusable(code, prefill.lease_deadline_unix_ms, time.time() * 1e3)

    def _continuation(self, run: RequestRun, prefill: PrefillResult) -> GenerateRequest:
        """Recompute on the next decode worker: the pinned copy will not be pulled, so unpin it."""
        prefill_worker = run.touched.pop(run.prefill_worker_id, None) if run.prefill_worker_id else None
        if prefill_worker is not None:
            self._aborts.send(prefill_worker, run.request.request_id)
        return continuation(run.request, prefill.first)


def _last(run: RequestRun, tokens: Tokens, finish_reason: FinishReason) -> OutputChunk:
    return run.last_chunk(tokens, finish_reason, time.monotonic())


def _broken_stream(error: WorkerCallError, run: RequestRun, why: str) -> WorkerCallError:
    """The error a caller gets when its stream broke after tokens went out: UNAVAILABLE, with advice."""
    return WorkerCallError(error.worker_id, error.method, error.code, (
        f"{error.details}; the stream broke after {len(run.sent_token_ids)} tokens were sent, {why}: "
        "retry the request"
    ))  # fmt: skip


@dataclass(frozen=True)
class _Closer:
    """Cancels a decode call when its block is left, early (client gone, error) or not (a no-op then)."""

    close: Callable[[], None]
