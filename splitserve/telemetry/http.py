"""Tracing of the HTTP front door (ASGI) and of SDK calls to the router.

    app.add_middleware(TraceMiddleware, service="splitserve-gateway")      # gateway/app.py

For each HTTP request the middleware opens the `gateway.request` SERVER span, as a child of the
client's own `traceparent` header when it sends a valid one, and answers with a `traceparent`
header naming that span (so a client can find its trace). While the request runs, a
`RequestTimeline` is current; SDK calls made for it (`TracedCall`, client/*.py) add to it:

    request ──▶ gateway.preprocess ──▶ router.Generate (client span) ─ first message ─▶ gateway.first_chunk ──▶ first body
               (parse, tokenize)       (the router's own spans inside)                  (detokenize, SSE)      FIRST_TOKEN event

`X-Splitserve-Timing: 1` on a request asks for its timing breakdown in the answer: a JSON answer
gets a top-level `splitserve_timing` object; a stream gets one more event before `data: [DONE]`,
`{"object": "splitserve.timing", "choices": [], "splitserve_timing": {...}}`.
"""

from __future__ import annotations

import contextvars
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from splitserve.telemetry.propagation import context_from_headers, inject_headers, inject_metadata
from splitserve.telemetry.spans import (
    FIRST_MESSAGE,
    FIRST_TOKEN,
    TTFT_PHASE,
    detach_quietly,
    emit_span,
    mark_error,
    start_client_span,
    trace_id_hex,
)
from splitserve.telemetry.tracing import tracer

TIMING_HEADER = "x-splitserve-timing"
_DONE = b"data: [DONE]"


@dataclass
class RequestTimeline:
    """One HTTP request's instants (time.time_ns()) and what its router calls reported."""

    started_ns: int
    span: trace.Span
    wants_timing: bool = False
    first_call_ns: int | None = None
    first_chunk_ns: int | None = None
    first_token_ns: int | None = None
    is_stream: bool = False
    """An SSE answer (its first token is its first chunk); else a JSON one (see `_first_token`)."""
    router_timing: list = field(default_factory=list)
    """The router's TimingSummary messages (one per choice), when timing was asked for."""

    def summary(self) -> dict:
        """The `splitserve_timing` object: gateway phases, then the router's (first choice)."""

        def ms(a: int | None, b: int | None) -> float:
            return round((b - a) / 1e6, 3) if a is not None and b is not None else 0.0

        phases = [{"name": "gateway.preprocess", "ms": ms(self.started_ns, self.first_call_ns), "is_ttft": True}]
        out = {"trace_id": trace_id_hex(self.span), "time_to_first_token_ms": ms(self.started_ns, self.first_token_ns)}
        if self.router_timing:
            t = self.router_timing[0]
            router_ms = t.time_to_first_token_ms
            rpc = ms(self.first_call_ns, self.first_chunk_ns) - router_ms
            phases.append({"name": "rpc.router", "ms": round(max(0.0, rpc), 3), "is_ttft": True})
            phases += [{"name": p.name, "ms": round(p.ms, 3), "is_ttft": p.is_ttft} for p in t.phases]
            out.update(router_time_to_first_token_ms=round(router_ms, 3), total_ms=round(t.total_ms, 3),
                       kv_transfer_bytes=t.kv_transfer_bytes, kv_transfer_gbps=round(t.kv_transfer_gbps, 3))  # fmt: skip
        if self.is_stream:
            phases.append({"name": "gateway.first_chunk", "ms": ms(self.first_chunk_ns, self.first_token_ns),
                           "is_ttft": True})  # fmt: skip
        out["phases"] = phases
        return out


_timeline: contextvars.ContextVar[RequestTimeline | None] = contextvars.ContextVar("splitserve_timeline", default=None)


def time_to_first_message_s() -> float | None:
    """Seconds from the start of the HTTP request being served to the router's first message (its
    first token); None outside a traced request or before any message. A JSON answer's TTFT, for
    the gateway's histogram (see `TraceMiddleware._first_token`)."""
    timeline = _timeline.get()
    if timeline is None or timeline.first_chunk_ns is None:
        return None
    return (timeline.first_chunk_ns - timeline.started_ns) / 1e9


def wants_timing() -> bool:
    """Did the HTTP request being served ask for its timing breakdown (X-Splitserve-Timing: 1)?"""
    timeline = _timeline.get()
    return timeline is not None and timeline.wants_timing


class TracedCall:
    """The client span of one router call (all its retries), with the trace context for its metadata.

        with TracedCall("router.Generate", options.metadata, request_id) as traced:
            call = stub.Generate(request, metadata=traced.metadata)
            for message in call:
                traced.on_message(message)
    """

    def __init__(self, name: str, metadata: Iterable[tuple[str, str]], request_id: str) -> None:
        self.timeline = _timeline.get()
        now = time.time_ns()
        if self.timeline is not None and self.timeline.first_call_ns is None:
            self.timeline.first_call_ns = now
            emit_span("gateway.preprocess", self.timeline.started_ns, now, is_ttft_phase=True,
                      parent=trace.set_span_in_context(self.timeline.span))  # fmt: skip
        self.span, ctx = start_client_span(name, {"splitserve.request_id": request_id})
        self.metadata = inject_metadata(metadata, ctx)
        self._is_first = True

    def on_message(self, message) -> None:
        if self._is_first:
            self._is_first = False
            self.span.add_event(FIRST_MESSAGE)
            if self.timeline is not None and self.timeline.first_chunk_ns is None:
                self.timeline.first_chunk_ns = time.time_ns()
        if self.timeline is not None and self.timeline.wants_timing and message.HasField("timing"):
            self.timeline.router_timing.append(message.timing)

    def __enter__(self) -> TracedCall:
        return self

    def __exit__(self, kind, error, tb) -> None:
        if error is not None and not isinstance(error, GeneratorExit):
            mark_error(self.span, error)
        self.span.end()


class TraceMiddleware:
    """Pure ASGI middleware (streaming-safe): the request span, traceparent in and out, the first
    token's instant, and the timing breakdown when asked for."""

    def __init__(self, app, service: str = "splitserve-gateway") -> None:
        self.app = app
        self.service = service

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        path = scope.get("path", "")
        span = tracer().start_span(
            f"{scope.get('method', 'GET')} {path}", context=context_from_headers(headers), kind=SpanKind.SERVER,
            attributes={"http.request.method": scope.get("method", ""), "url.path": path, "gateway.request": True},
        )  # fmt: skip
        span_context = trace.set_span_in_context(span)
        timeline = RequestTimeline(getattr(span, "start_time", None) or time.time_ns(), span, headers.get(TIMING_HEADER, "") in ("1", "true"))
        token = otel_context.attach(span_context)
        timeline_token = _timeline.set(timeline)
        state = {"status": 0, "is_json": False, "held": None}

        async def traced_send(message) -> None:
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                out = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"traceparent"]
                out += [(k.encode(), v.encode()) for k, v in inject_headers({}, span_context).items()]
                content_type = dict(message.get("headers", ())).get(b"content-type", b"")
                timeline.is_stream = content_type.startswith(b"text/event-stream")
                state["is_json"] = timeline.wants_timing and content_type.startswith(b"application/json")
                if state["is_json"]:  # the body is rewritten: hold the start until it is
                    state["held"] = {**message, "headers": [(k, v) for k, v in out if k.lower() != b"content-length"]}
                    return
                message = {**message, "headers": out}
            elif message["type"] == "http.response.body":
                body = message.get("body", b"")
                if body and timeline.first_chunk_ns is not None and timeline.first_token_ns is None:
                    self._first_token(timeline)
                if state["is_json"]:
                    message = self._with_timing_json(state, message, timeline)
                    if message is None:
                        return
                    await send(state.pop("held"))
                elif timeline.wants_timing and _DONE in body:
                    extra = json.dumps({"object": "splitserve.timing", "choices": [], "splitserve_timing": timeline.summary()})
                    message = {**message, "body": body.replace(_DONE, f"data: {extra}\n\n".encode() + _DONE, 1)}
            await send(message)

        try:
            await self.app(scope, receive, traced_send)
        except BaseException as exc:
            mark_error(span, exc)
            raise
        finally:
            span.set_attribute("http.response.status_code", state["status"])
            if state["status"] >= 500:
                mark_error(span, f"HTTP {state['status']}")
            span.end()
            _timeline.reset(timeline_token)
            detach_quietly(token)

    @staticmethod
    def _first_token(timeline: RequestTimeline) -> None:
        """A stream's first token is its first body chunk (`gateway.first_chunk`: the router's first
        message → that chunk: detokenize, SSE). A JSON answer's first body is the whole answer,
        written after the last token: counting to it would call the whole decode "time to first
        token" and put it in the gateway's last phase. Its first token is the instant the router's
        first message reached the gateway, as engines count TTFT whether or not a client streams."""
        now = time.time_ns() if timeline.is_stream else timeline.first_chunk_ns
        timeline.first_token_ns = now
        timeline.span.add_event(FIRST_TOKEN, timestamp=now)
        timeline.span.set_attribute("splitserve.streamed", timeline.is_stream)
        if timeline.is_stream:
            emit_span("gateway.first_chunk", timeline.first_chunk_ns, now,
                      parent=trace.set_span_in_context(timeline.span), is_ttft_phase=True)  # fmt: skip
        timeline.span.set_attribute("splitserve.ttft_ms", (now - timeline.started_ns) / 1e6)

    @staticmethod
    def _with_timing_json(state: dict, message: dict, timeline: RequestTimeline) -> dict | None:
        """Buffers a JSON body; at its end, the whole body with `splitserve_timing` added (None until then)."""
        state["buffer"] = state.get("buffer", b"") + message.get("body", b"")
        if message.get("more_body", False):
            return None
        try:
            document = json.loads(state["buffer"])
            if isinstance(document, dict):
                document["splitserve_timing"] = timeline.summary()
                state["buffer"] = json.dumps(document).encode()
        except ValueError:
            pass
        body = state["buffer"]
        state["held"]["headers"].append((b"content-length", str(len(body)).encode()))
        return {"type": "http.response.body", "body": body, "more_body": False}


__all__ = ["TIMING_HEADER", "TTFT_PHASE", "RequestTimeline", "TraceMiddleware", "TracedCall", "wants_timing"]
