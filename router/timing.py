"""The timing breakdown of one request (TimingSummary.phases), from what the router measured and
what the workers reported (PrefillTiming, DecodeTiming). Pure: no clocks read here.

    disaggregated:  router.route ─ rpc.prefill ─ prefill.queue ─ prefill.compute ─ prefill.emit
                    ─ router.first_token ║ handoff.publish ─ rpc.decode ─ decode.queue ─ kv.transfer
                    ─ decode.first_step ─ decode.stream
                    (PrefillStream: the first token leaves before the handoff is published; a unary
                    Prefill reply, first_token_ms 0, has handoff.publish on the TTFT path instead
                    of prefill.emit)
    aggregated:     router.route ─ rpc.decode ─ decode.queue ─ decode.prefill ─ decode.emit
                    ─ router.first_token ║ decode.stream

Phases left of ║ are on the TTFT path (is_ttft) and add up to the router's time to first
token, less the router's own bookkeeping between them. `rpc.*` is a call's duration (until its
first reply) less the worker's own time: network, serialization and gRPC queues.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.router.messages import DecodeTiming, PrefillTiming, TimingPhase


@dataclass(frozen=True)
class RouterTimes:
    """Milliseconds the router measured itself."""

    route_ms: float
    prefill_retry_ms: float
    """Failed prefill attempts before the one that answered."""
    prefill_call_ms: float
    """The Prefill call that answered, send to its first token (the reply, for unary Prefill)."""
    decode_first_chunk_ms: float
    """The Decode call that served the request, send to its first message received."""
    relay_ms: float
    """First token in hand (prefill reply or first decode chunk) to it being sent to the caller."""


def phases(
    times: RouterTimes, prefill: PrefillTiming | None, decode: DecodeTiming | None
) -> tuple[TimingPhase, ...]:
    out = [TimingPhase("router.route", times.route_ms, True)]
    if times.prefill_retry_ms > 0:
        out.append(TimingPhase("prefill.failed_attempts", times.prefill_retry_ms, True))
    d = decode or DecodeTiming()
    if prefill is not None:
        streamed = prefill.first_token_ms > 0
        worker_ms = prefill.first_token_ms if streamed else prefill.handler_ms
        out += [
            TimingPhase("rpc.prefill", max(0.0, times.prefill_call_ms - worker_ms), True),
            TimingPhase("prefill.queue", prefill.queue_ms, True),
            TimingPhase("prefill.compute", prefill.compute_ms, True),
        ]
        if streamed:
            emit_ms = max(0.0, prefill.first_token_ms - prefill.queue_ms - prefill.compute_ms)
            out.append(TimingPhase("prefill.emit", emit_ms, True))
        out += [
            TimingPhase("handoff.publish", prefill.publish_ms, not streamed),
            TimingPhase("router.first_token", times.relay_ms, True),
        ]
        if decode is not None:
            out += [
                TimingPhase("rpc.decode", max(0.0, times.decode_first_chunk_ms - d.first_chunk_ms), False),
                TimingPhase("decode.queue", d.queue_ms, False),
                TimingPhase("kv.transfer", d.transfer_ms, False),
                TimingPhase("decode.first_step", d.first_step_ms, False),
                TimingPhase("decode.stream", d.stream_ms, False),
            ]
        return tuple(out)
    if decode is None:
        return tuple(out)
    emit = max(0.0, d.first_chunk_ms - d.queue_ms - d.prefill_ms)
    out += [
        TimingPhase("rpc.decode", max(0.0, times.decode_first_chunk_ms - d.first_chunk_ms), True),
        TimingPhase("decode.queue", d.queue_ms, True),
        TimingPhase("decode.prefill", d.prefill_ms, True),
        TimingPhase("decode.emit", emit, True),
        TimingPhase("router.first_token", times.relay_ms, True),
        TimingPhase("decode.stream", d.stream_ms, False),
    ]
    return tuple(out)
