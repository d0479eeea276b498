"""W3C trace context across gRPC metadata (a real grpc.aio call) and HTTP headers (the gateway's
ASGI middleware): a client's own traceparent becomes the parent; malformed ones are ignored."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry import trace
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from splitserve.telemetry.http import TraceMiddleware
from splitserve.telemetry.propagation import (
    context_from_headers,
    context_from_metadata,
    inject_headers,
    inject_metadata,
)
from splitserve.telemetry.spans import start_client_span, start_server_span
from splitserve.telemetry.tracing import tracer

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def _ids(span) -> tuple[str, str]:
    ctx = span.get_span_context()
    return trace.format_trace_id(ctx.trace_id), trace.format_span_id(ctx.span_id)


def test_metadata_round_trip_keeps_other_entries_and_replaces_a_stale_traceparent(spans):
    with tracer().start_as_current_span("caller") as caller:
        metadata = inject_metadata((("authorization", "Bearer k"), ("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01")))
    keys = [k for k, _ in metadata]
    assert keys.count("traceparent") == 1 and ("authorization", "Bearer k") in metadata
    server, _ = start_server_span("server", metadata)
    server.end()
    assert server.parent.span_id == caller.get_span_context().span_id
    assert _ids(server)[0] == _ids(caller)[0]


@pytest.mark.parametrize("bad", ["", "garbage", "00-" + "0" * 32 + "-" + "1" * 16 + "-01", "00-xyz-abc-01"])
def test_missing_or_malformed_traceparent_starts_a_new_trace(spans, bad):
    assert not trace.get_current_span(context_from_metadata([("traceparent", bad)])).get_span_context().is_valid
    assert not trace.get_current_span(context_from_headers({"traceparent": bad})).get_span_context().is_valid


def test_headers_round_trip():
    headers = inject_headers({}, context_from_headers({"traceparent": TRACEPARENT, "tracestate": "vendor=x"}))
    assert headers["traceparent"].split("-")[1] == TRACE_ID and headers["tracestate"] == "vendor=x"


class _RecordingHealth(health.aio.HealthServicer):
    async def Check(self, request, context):  # noqa: N802
        span, _ = start_server_span("health.check", context.invocation_metadata())
        span.end()
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def test_traceparent_travels_in_real_grpc_metadata(spans):
    async def main():
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(_RecordingHealth(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                client, ctx = start_client_span("health.Check")
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), metadata=inject_metadata((), ctx))
                client.end()
                # An SDK user's own traceparent (no OTel in the caller) is honoured as well.
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), metadata=(("traceparent", TRACEPARENT),))
        finally:
            await server.stop(None)
        return client

    client = asyncio.run(main())
    checks = [s for s in spans.get_finished_spans() if s.name == "health.check"]
    assert checks[0].parent.span_id == client.get_span_context().span_id
    assert checks[0].context.trace_id == client.get_span_context().trace_id
    assert format(checks[1].context.trace_id, "032x") == TRACE_ID and format(checks[1].parent.span_id, "016x") == PARENT_ID


async def _post(app, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One POST through an ASGI app, the way a server drives it: (status, headers, body)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "path": path,
             "raw_path": path.encode(), "query_string": b"", "scheme": "http", "server": ("gateway", 80),
             "client": ("127.0.0.1", 1), "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}  # fmt: skip
    messages = [{"type": "http.request", "body": b"", "more_body": False}]
    sent: list[dict] = []

    async def receive():
        if messages:
            return messages.pop()
        await asyncio.sleep(3600)  # no disconnect

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body


def _app():
    async def answer(request):
        return JSONResponse({"id": "x", "object": "text_completion"})

    async def stream(request):
        async def events():
            yield b'data: {"choices": [{"text": "a"}]}\n\n'
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/answer", answer, methods=["POST"]), Route("/stream", stream, methods=["POST"])])
    app.add_middleware(TraceMiddleware)
    return app


def test_http_client_traceparent_is_honoured_and_echoed(spans):
    async def main():
        app = _app()
        return await _post(app, "/answer", {"traceparent": TRACEPARENT}), await _post(app, "/answer")

    (status, headers, body), (_, fresh, _) = asyncio.run(main())
    root = next(s for s in spans.get_finished_spans() if s.name == "POST /answer" and s.parent is not None)
    assert format(root.context.trace_id, "032x") == TRACE_ID and format(root.parent.span_id, "016x") == PARENT_ID
    assert headers["traceparent"].split("-")[1:3] == [TRACE_ID, format(root.context.span_id, "016x")]
    assert fresh["traceparent"].split("-")[1] != TRACE_ID  # a fresh trace, still named
    assert status == 200 and json.loads(body) == {"id": "x", "object": "text_completion"}  # untouched unless asked


def test_timing_breakdown_is_added_when_asked(spans):
    async def main():
        app = _app()
        asked = {"X-Splitserve-Timing": "1"}
        return await _post(app, "/answer", asked), await _post(app, "/stream", asked)

    (_, headers, body), (_, _, stream) = asyncio.run(main())
    answer = json.loads(body)
    assert answer["object"] == "text_completion" and answer["splitserve_timing"]["trace_id"]
    assert int(headers["content-length"]) == len(body)
    events = [chunk.removeprefix("data: ") for chunk in stream.decode().split("\n\n") if chunk]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["object"] == "splitserve.timing"


def test_logs_carry_the_trace_id_and_leave_prompts_out(spans, monkeypatch, capsys):
    import logging

    from splitserve.telemetry.logs import JsonFormatter, TraceContextFilter, may_log_prompts

    record_handler = logging.StreamHandler()
    record_handler.addFilter(TraceContextFilter())
    record_handler.setFormatter(JsonFormatter("svc"))
    logger = logging.getLogger("splitserve.test.telemetry")
    logger.addHandler(record_handler)
    logger.setLevel(logging.INFO)
    try:
        with tracer().start_as_current_span("request") as span:
            logger.info("routed %s", "r1", extra={"request_id": "r1"})
        logger.info("outside")
    finally:
        logger.removeHandler(record_handler)
    inside, outside = (json.loads(line) for line in capsys.readouterr().err.splitlines()[-2:])
    assert inside["trace_id"] == format(span.get_span_context().trace_id, "032x") and inside["request_id"] == "r1"
    assert inside["service"] == "svc" and inside["message"] == "routed r1"
    assert outside["trace_id"] == ""
    monkeypatch.delenv("SPLITSERVE_LOG_PROMPTS", raising=False)
    assert not may_log_prompts()
    monkeypatch.setenv("SPLITSERVE_LOG_PROMPTS", "1")
    assert may_log_prompts()


class _RouterMessage:
    """Stands in for a router Generate message: TracedCall reads only whether it carries timing."""

    def HasField(self, name):  # noqa: N802 - the protobuf method's name
        return False


def _decoding_app(decode_s: float):
    """Endpoints that call the "router" through TracedCall: its first message (the first token)
    arrives, then the rest of the decode takes `decode_s` before the answer is written."""
    from splitserve.telemetry.http import TracedCall, time_to_first_message_s

    seen = {}

    async def decode():
        with TracedCall("router.Generate", (), "r1") as traced:
            traced.on_message(_RouterMessage())
            await asyncio.sleep(decode_s)
        seen["first_message_s"] = time_to_first_message_s()

    async def answer(request):
        await decode()
        return JSONResponse({"id": "x", "object": "text_completion"})

    async def stream(request):
        async def events():
            with TracedCall("router.Generate", (), "r1") as traced:
                traced.on_message(_RouterMessage())
                yield b'data: {"choices": [{"text": "a"}]}\n\n'
                await asyncio.sleep(decode_s)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/answer", answer, methods=["POST"]), Route("/stream", stream, methods=["POST"])])
    app.add_middleware(TraceMiddleware)
    return app, seen


def test_a_json_answer_s_first_token_is_the_router_s_first_message_not_the_whole_decode(spans):
    decode_s = 0.3
    app, seen = _decoding_app(decode_s)

    async def main():
        return await _post(app, "/answer", {"X-Splitserve-Timing": "1"}), await _post(app, "/stream")

    (_, _, body), _ = asyncio.run(main())
    finished = spans.get_finished_spans()
    for path, streamed in (("/answer", False), ("/stream", True)):
        root = next(s for s in finished if s.name == f"POST {path}")
        first_token = next(e for e in root.events if e.name == "first_token")
        ttft_s = (first_token.timestamp - root.start_time) / 1e9
        assert root.attributes["splitserve.streamed"] is streamed
        assert ttft_s < decode_s / 2 and root.attributes["splitserve.ttft_ms"] < 1e3 * decode_s / 2, (path, ttft_s)
        assert (root.end_time - root.start_time) / 1e9 >= decode_s  # the decode itself still counts in the request
        chunks = [s for s in finished if s.name == "gateway.first_chunk" and s.parent.span_id == root.context.span_id]
        assert len(chunks) == streamed  # detokenize + SSE of the first chunk: a stream's phase only
    timing = json.loads(body)["splitserve_timing"]
    assert timing["time_to_first_token_ms"] < 1e3 * decode_s / 2
    assert "gateway.first_chunk" not in [p["name"] for p in timing["phases"]]
    assert 0 < seen["first_message_s"] < decode_s / 2  # what the gateway's TTFT histogram observes
