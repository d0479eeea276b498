"""OTLP/HTTP export end to end: a process configured only by OTEL_* variables sends its spans to
a receiver inside the test (protobuf ExportTraceServiceRequest), flushed at exit; and with no
collector listening, nothing breaks."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

SCRIPT = """
from splitserve.telemetry import init_process
from splitserve.telemetry.tracing import tracer
init_process("splitserve-probe")
with tracer().start_as_current_span("probe.request", attributes={"splitserve.request_id": "r1"}):
    with tracer().start_as_current_span("probe.phase"):
        pass
"""


def _receiver():
    received: list[ExportTraceServiceRequest] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            message = ExportTraceServiceRequest()
            message.ParseFromString(body)
            received.append((self.path, message))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, received


def test_spans_reach_an_otlp_http_receiver():
    server, received = _receiver()
    try:
        env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
               "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_port}", "PATH": "/usr/bin:/bin"}  # fmt: skip
        run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
    finally:
        server.shutdown()
    spans = {}
    for path, message in received:
        assert path == "/v1/traces"
        for rs in message.resource_spans:
            service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
            for ss in rs.scope_spans:
                spans.update({s.name: (service, s) for s in ss.spans})
    assert set(spans) == {"probe.request", "probe.phase"}
    assert spans["probe.request"][0] == "splitserve-probe"
    assert spans["probe.phase"][1].parent_span_id == spans["probe.request"][1].span_id


def test_no_collector_breaks_nothing():
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "PATH": "/usr/bin:/bin",
           "OTEL_BSP_EXPORT_TIMEOUT": "500", "OTEL_EXPORTER_OTLP_TIMEOUT": "1"}  # fmt: skip
    run = subprocess.run([sys.executable, "-c", SCRIPT + "\nprint('served')"], env=env, capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert run.returncode == 0 and "served" in run.stdout, run.stderr
