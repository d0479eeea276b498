"""Span helpers shared by the processes: server spans from propagated context, spans with
measured (past) start and end times, and the attribute names the TTFT report reads.

Two attributes tie the breakdown together (`splitserve trace report`, report.py):

    splitserve.ttft_phase = True   a leaf span on the path to the first token; such spans,
                                   with the RPC time between the hops, add up to the TTFT
    splitserve.rpc = True          a client span whose child is the callee's server span; its
                                   time outside that child (until the first message) is the hop's
                                   network + serialization time

Every RPC span records the `first_message` event (client: first reply message received;
server: first reply message sent), so a streaming hop's share of the TTFT is measurable.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from splitserve.telemetry.propagation import context_from_metadata
from splitserve.telemetry.tracing import tracer

TTFT_PHASE = "splitserve.ttft_phase"
RPC = "splitserve.rpc"
FIRST_MESSAGE = "first_message"
"""Event: an RPC span's first reply message (received by a client span, sent by a server span)."""
FIRST_TOKEN = "first_token"
"""Event on the gateway's request span: the first generated token left for the client."""

AttributeValue = str | bool | int | float


def mono_to_unix_ns(t: float) -> int:
    """Wall-clock ns (the spans' clock) of a `time.monotonic()` instant of this process."""
    return time.time_ns() - int((time.monotonic() - t) * 1e9)


def emit_span(
    name: str,
    start_ns: int,
    end_ns: int,
    attributes: Mapping[str, AttributeValue] | None = None,
    *,
    parent: otel_context.Context | None = None,
    is_ttft_phase: bool = False,
    kind: SpanKind = SpanKind.INTERNAL,
) -> Span:
    """A finished span over a measured interval (e.g. engine timestamps), child of `parent`
    (default: the current span). An end before the start is clamped to the start."""
    attrs = dict(attributes or {})
    if is_ttft_phase:
        attrs[TTFT_PHASE] = True
    span = tracer().start_span(name, context=parent, kind=kind, attributes=attrs, start_time=start_ns)
    span.end(end_time=max(start_ns, end_ns))
    return span


def start_server_span(
    name: str, metadata: Iterable[tuple[str, str | bytes]] | None, attributes: Mapping[str, AttributeValue] | None = None
) -> tuple[Span, otel_context.Context]:
    """A SERVER span whose parent is the caller's propagated context; returns it and its context
    (pass that context explicitly inside async generators, where "current" may change hands)."""
    span = tracer().start_span(name, context=context_from_metadata(metadata), kind=SpanKind.SERVER,
                               attributes=dict(attributes or {}))  # fmt: skip
    return span, trace.set_span_in_context(span)


def start_client_span(
    name: str, attributes: Mapping[str, AttributeValue] | None = None, *, parent: otel_context.Context | None = None
) -> tuple[Span, otel_context.Context]:
    """A CLIENT span of one RPC (marked `splitserve.rpc`); inject its context into the call's metadata."""
    attrs = {RPC: True, **(attributes or {})}
    span = tracer().start_span(name, context=parent, kind=SpanKind.CLIENT, attributes=attrs)
    return span, trace.set_span_in_context(span, parent)


@contextlib.contextmanager
def attached(ctx: otel_context.Context) -> Iterator[None]:
    """Makes `ctx` current (logs carry its trace id; child spans default to it); detaching never
    raises, even when an async generator is closed from another task."""
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        detach_quietly(token)


def detach_quietly(token) -> None:
    with contextlib.suppress(ValueError, RuntimeError):
        token.var.reset(token)


def mark_error(span: Span, error: BaseException | str) -> None:
    span.set_status(Status(StatusCode.ERROR, str(error)))
    if isinstance(error, BaseException):
        span.record_exception(error)


def trace_id_hex(span: Span | None = None) -> str:
    """32 hex digits of `span`'s (default: the current span's) trace id; "" when there is none."""
    span = span if span is not None else trace.get_current_span()
    ctx = span.get_span_context()
    return trace.format_trace_id(ctx.trace_id) if ctx.is_valid else ""
