"""What the router records about one request: metrics and span attributes at its end, and the
decode worker's measured KV transfer on the router's Decode span. Pure recording, no decisions."""

from __future__ import annotations

from splitserve.router.messages import DecodeTiming
from splitserve.router.request_run import RequestRun
from splitserve.telemetry.metrics import RouterMetrics


def record_finished(metrics: RouterMetrics, span, run: RequestRun, outcome: str) -> None:
    """Counters and the Router.Generate span's attributes of a request that ended (any outcome)."""
    request = run.request
    metrics.in_flight.dec()
    metrics.requests.labels(outcome).inc()
    metrics.cached_tokens.inc(run.num_cached_tokens)
    if run.decode_timing is not None:
        metrics.transfer_bytes.inc(run.decode_timing.transfer_bytes)
    span.set_attributes({
        "splitserve.request_id": request.request_id, "splitserve.outcome": outcome,
        "splitserve.prompt_tokens": len(request.token_ids), "splitserve.completion_tokens": run.num_completion_tokens,
        "splitserve.cache.predicted_tokens": run.predicted_cached_tokens,
        "splitserve.cache.actual_tokens": run.num_cached_tokens,
        "splitserve.prefill_worker": run.prefill_worker_id or "", "splitserve.decode_worker": run.decode_worker_id,
        "splitserve.num_prefill_attempts": run.num_prefill_attempts,
        "splitserve.num_decode_attempts": run.num_decode_attempts,
    })  # fmt: skip


def transfer_attributes(span, timing: DecodeTiming) -> None:
    """The decode worker's measured KV transfer, on the router's Decode span too."""
    if timing.transport:
        span.set_attributes({
            "splitserve.kv.bytes": timing.transfer_bytes, "splitserve.kv.seconds": timing.transfer_seconds,
            "splitserve.kv.transport": timing.transport,
        })  # fmt: skip
