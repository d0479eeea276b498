"""`splitserve trace report`: spans (as the jsonl, console and OTLP-JSON exporters write them) ->
per-request TTFT breakdown (phases + measured RPC hops + unaccounted rest), a table and a PNG.
Also the router's own breakdown (router/timing.py) that `return_timing` sends back."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind, set_span_in_context

from splitserve.router.messages import DecodeTiming, PrefillTiming
from splitserve.router.timing import RouterTimes, phases
from splitserve.telemetry.report import (
    format_table,
    load_traces,
    parse_spans,
    render_waterfall,
    ttft_breakdown,
)
from splitserve.telemetry.spans import FIRST_MESSAGE, FIRST_TOKEN, RPC, TTFT_PHASE
from splitserve.telemetry.tracing import JsonLinesSpanExporter

MS = 1_000_000


def _write_trace(path, t0: int = 1_700_000_000_000_000_000) -> str:
    """A disaggregated request's spans from three processes (made with the SDK, times explicit).

    gateway [0, 100]: preprocess [0, 2], client call [2, 100] (first message at 93), first chunk [93, 95], FIRST_TOKEN 95
    router  [3, 99]: route [3, 4], prefill call [4, 90] -> prefill server [5, 88]: queue [5, 10], compute [10, 80],
            publish [80, 88]; relay [90, 91]; first message sent at 91; decode call [91, 99] (after the TTFT)
    """
    exporter = JsonLinesSpanExporter(str(path))

    def tracer(service):
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        return provider.get_tracer("test")

    gw, rt, pf = tracer("splitserve-gateway"), tracer("splitserve-router"), tracer("splitserve-prefill-worker")

    def span(tr, name, start, end, parent=None, attrs=None, kind=SpanKind.INTERNAL, events=()):
        s = tr.start_span(name, context=parent and set_span_in_context(parent), kind=kind, attributes=attrs or {},
                          start_time=t0 + start * MS)  # fmt: skip
        for event, at in events:
            s.add_event(event, timestamp=t0 + at * MS)
        return s, lambda: s.end(end_time=t0 + end * MS)

    phase = {TTFT_PHASE: True}
    root, end_root = span(gw, "POST /v1/completions", 0, 100, kind=SpanKind.SERVER, events=[(FIRST_TOKEN, 95)])
    span(gw, "gateway.preprocess", 0, 2, root, phase)[1]()
    call, end_call = span(gw, "router.Generate", 2, 100, root, {RPC: True}, SpanKind.CLIENT, [(FIRST_MESSAGE, 93)])
    server, end_server = span(rt, "router.generate", 3, 99, call, kind=SpanKind.SERVER, events=[(FIRST_MESSAGE, 91)])
    span(rt, "router.route", 3, 4, server, phase)[1]()
    pcall, end_pcall = span(rt, "router.prefill", 4, 90, server, {RPC: True}, SpanKind.CLIENT, [(FIRST_MESSAGE, 90)])
    pserver, end_pserver = span(pf, "prefill.request", 5, 88, pcall, kind=SpanKind.SERVER)
    for name, a, b in (("prefill.queue", 5, 10), ("prefill.compute", 10, 80), ("handoff.publish", 80, 88)):
        span(pf, name, a, b, pserver, phase)[1]()
    end_pserver(), end_pcall()
    span(rt, "router.first_token", 90, 91, server, phase)[1]()
    span(rt, "router.decode", 91, 99, server, {RPC: True}, SpanKind.CLIENT)[1]()
    span(gw, "gateway.first_chunk", 93, 95, root, phase)[1]()
    end_server(), end_call(), end_root()
    exporter.shutdown()
    return format(root.get_span_context().trace_id, "032x")


def test_breakdown_adds_phases_and_measured_hops(tmp_path):
    trace_id = _write_trace(tmp_path / "spans.jsonl")
    traces = load_traces([tmp_path / "spans.jsonl"])
    b = ttft_breakdown(traces[trace_id])
    assert b.ttft_ms == pytest.approx(95)
    got = {p.name: round(p.ms, 6) for p in b.phases}
    assert got == {
        "gateway.preprocess": 2, "rpc gateway->router": 1 + 2, "router.route": 1,
        "rpc router->prefill-worker": 1 + 2, "prefill.queue": 5, "prefill.compute": 70, "handoff.publish": 8,
        "router.first_token": 1, "gateway.first_chunk": 2,
    }  # fmt: skip
    assert b.accounted_ms == pytest.approx(95) and b.unaccounted_ms == pytest.approx(0)  # the spans tile the TTFT
    table = format_table([b])
    assert "prefill.compute" in table and "unaccounted" in table and "TTFT 95.00 ms" in table


def test_console_and_otlp_json_exports_parse_like_jsonl(tmp_path):
    trace_id = _write_trace(tmp_path / "spans.jsonl")
    records = [json.loads(line) for line in (tmp_path / "spans.jsonl").read_text().splitlines()]
    console = "log line before\n" + "\n".join(json.dumps(r, indent=4) for r in records) + "\nlog line after\n"
    spans = parse_spans(console)
    assert len(spans) == len(records) and {s.trace_id for s in spans} == {trace_id}
    r = records[0]
    otlp = {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "svc"}}]},
             "scopeSpans": [{"spans": [{"traceId": r["context"]["trace_id"][2:], "spanId": r["context"]["span_id"][2:],
                                        "name": r["name"], "kind": 2, "startTimeUnixNano": "1", "endTimeUnixNano": "3000001",
                                        "attributes": [{"key": TTFT_PHASE, "value": {"boolValue": True}}]}]}]}]}  # fmt: skip
    [span] = parse_spans(json.dumps(otlp))
    assert span.service == "svc" and span.duration_ms == pytest.approx(3) and span.attributes[TTFT_PHASE] is True
    assert span.kind == "SERVER"


def test_trace_report_command_writes_a_png_and_a_table(tmp_path):
    trace_id = _write_trace(tmp_path / "spans.jsonl")
    _write_trace(tmp_path / "spans.jsonl", t0=1_700_000_001_000_000_000)
    out = tmp_path / "ttft.png"
    run = subprocess.run([sys.executable, "-m", "splitserve", "trace", "report", str(tmp_path / "spans.jsonl"),
                          "--out", str(out), "--trace-id", trace_id], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "2 requests" in run.stdout and f"trace {trace_id}" in run.stdout and "prefill.compute" in run.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    missing = subprocess.run([sys.executable, "-m", "splitserve", "trace", "report", str(tmp_path / "none.jsonl")],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert missing.returncode == 2 and "none.jsonl" in missing.stderr


def test_waterfall_renders_in_process(tmp_path):
    trace_id = _write_trace(tmp_path / "spans.jsonl")
    spans = load_traces([tmp_path])[trace_id]
    path = render_waterfall(spans, ttft_breakdown(spans), tmp_path / "w.png")
    assert path.stat().st_size > 10_000


def test_router_timing_phases_sum_to_its_ttft():
    times = RouterTimes(route_ms=1, prefill_retry_ms=0, prefill_call_ms=50, decode_first_chunk_ms=9, relay_ms=0.5)
    disagg = phases(times, PrefillTiming(46, 2, 40, 4, 3), DecodeTiming(queue_ms=1, transfer_ms=3, first_chunk_ms=5,
                                                                          first_step_ms=8, stream_ms=30))  # fmt: skip
    ttft = {p.name: p.ms for p in disagg if p.is_ttft}
    assert ttft == {"router.route": 1, "rpc.prefill": 4, "prefill.queue": 2, "prefill.compute": 40,
                    "handoff.publish": 4, "router.first_token": 0.5}  # fmt: skip
    assert {p.name for p in disagg if not p.is_ttft} == {"rpc.decode", "decode.queue", "kv.transfer", "decode.first_step",
                                                         "decode.stream"}  # fmt: skip
    aggregated = phases(times, None, DecodeTiming(queue_ms=2, prefill_ms=5, first_chunk_ms=8, stream_ms=20))
    ttft = {p.name: p.ms for p in aggregated if p.is_ttft}
    assert ttft == {"router.route": 1, "rpc.decode": 1, "decode.queue": 2, "decode.prefill": 5, "decode.emit": 1,
                    "router.first_token": 0.5}  # fmt: skip


def test_exporters_come_from_the_otel_variables_and_default_to_none(tmp_path):
    import os

    from splitserve.telemetry.tracing import _exporters

    assert _exporters({}, "svc") == []  # off by default: nothing is sent anywhere
    [(exporter, is_batched)] = _exporters(
        {"OTEL_TRACES_EXPORTER": "jsonl", "SPLITSERVE_TRACES_FILE": str(tmp_path / "{service}-{pid}.jsonl")}, "svc"
    )
    assert isinstance(exporter, JsonLinesSpanExporter) and not is_batched
    assert exporter.path == str(tmp_path / f"svc-{os.getpid()}.jsonl")
    exporter.shutdown()
    # OTLP without a collector: built lazily (no connection until spans are sent), batched.
    chosen = _exporters({"OTEL_TRACES_EXPORTER": "otlp, console", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, "svc")
    assert [type(e).__module__.split(".")[-2:] for e, _ in chosen][0] == ["http", "trace_exporter"]
    assert [b for _, b in chosen] == [True, False]
    assert type(_exporters({"OTEL_TRACES_EXPORTER": "otlp"}, "svc")[0][0]).__module__.startswith(
        "opentelemetry.exporter.otlp.proto.grpc"
    )
    assert _exporters({"OTEL_TRACES_EXPORTER": "no-such-exporter"}, "svc") == []
