"""W3C trace context (`traceparent`, `tracestate`) in gRPC metadata and HTTP headers.

    metadata = inject_metadata(options.metadata)            # caller: current context -> metadata
    ctx = context_from_metadata(context.invocation_metadata())   # server: metadata -> parent context
    ctx = context_from_headers(request.headers)                 # HTTP server: a client's own traceparent

A missing or malformed `traceparent` gives an empty context (the span becomes a root), as the
W3C specification asks; it is never an error.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()
TRACE_HEADERS = ("traceparent", "tracestate")


def inject_metadata(metadata: Iterable[tuple[str, str]] = (), context: Context | None = None) -> tuple[tuple[str, str], ...]:
    """`metadata` plus the trace context of `context` (default: the current one); an existing
    traceparent in `metadata` is replaced, so a hop always names its own span as the parent."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=context)
    kept = tuple((k, v) for k, v in metadata if k.lower() not in carrier)
    return kept + tuple(carrier.items())


def context_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """The parent context a gRPC server span should have (empty when the caller sent none)."""
    carrier = {}
    for key, value in metadata or ():
        if key.lower() in TRACE_HEADERS and isinstance(value, str):
            carrier[key.lower()] = value
    return _propagator.extract(carrier)


def context_from_headers(headers: Mapping[str, str]) -> Context:
    """The parent context of an HTTP request's span: the client's own `traceparent`, if valid."""
    carrier = {}
    for name in TRACE_HEADERS:
        value = headers.get(name)
        if value:
            carrier[name] = value
    return _propagator.extract(carrier)


def inject_headers(headers: dict[str, str] | None = None, context: Context | None = None) -> dict[str, str]:
    """`headers` (a new dict if None) with the trace context of `context` added."""
    headers = {} if headers is None else headers
    _propagator.inject(headers, context=context)
    return headers
