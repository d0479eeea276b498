"""Tracer setup for every splitserve process, configured by the standard `OTEL_*` variables.

    setup_tracing("splitserve-router")      # once, at process start (idempotent)
    with tracer().start_as_current_span("router.route") as span: ...

Export (nothing is sent anywhere unless asked; no collector is needed):

    OTEL_TRACES_EXPORTER   none (default) | console | otlp | jsonl   (comma-separated for several)
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL
                           grpc (default) | http/protobuf            (otlp only; the endpoint comes from
                           OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT, read by the exporter itself)
    SPLITSERVE_TRACES_FILE path of the `jsonl` exporter (default splitserve-spans.jsonl); `{pid}` and
                           `{service}` are replaced, so one file per process is possible. Several
                           processes may append to one file: each span is one write of one line.
    OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER[_ARG], OTEL_BSP_*, OTEL_SDK_DISABLED
                           as the OpenTelemetry specification defines them.

Spans are made (and trace context propagated) even when nothing is exported, so a
client's `traceparent` reaches every hop and logs carry the trace id.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

log = logging.getLogger(__name__)

INSTRUMENTATION_NAME = "splitserve"
DEFAULT_TRACES_FILE = "splitserve-spans.jsonl"
_lock = threading.Lock()
_provider: TracerProvider | None = None


def tracer() -> trace.Tracer:
    """The splitserve tracer (a no-op one until `setup_tracing`)."""
    return trace.get_tracer(INSTRUMENTATION_NAME)


def setup_tracing(service_name: str, environ: dict[str, str] | None = None) -> TracerProvider | None:
    """Installs the process's TracerProvider from the environment; returns it (None if OTEL_SDK_DISABLED).

    Idempotent: a second call returns the first provider. `service_name` is used unless
    OTEL_SERVICE_NAME overrides it. Unknown exporter names are logged and ignored.
    """
    global _provider
    env = os.environ if environ is None else environ
    with _lock:
        if _provider is not None:
            return _provider
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return None
        attributes = {"service.name": env.get("OTEL_SERVICE_NAME") or service_name, "process.pid": os.getpid()}
        provider = TracerProvider(resource=Resource.create(attributes))
        for exporter, is_batched in _exporters(env, attributes["service.name"]):
            provider.add_span_processor(BatchSpanProcessor(exporter) if is_batched else SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        _provider = provider
        atexit.register(provider.shutdown)
        return provider


def shutdown_tracing() -> None:
    """Flushes and stops the exporters (also run at exit)."""
    if _provider is not None:
        _provider.force_flush()
        _provider.shutdown()


def _exporters(env, service: str) -> list[tuple[SpanExporter, bool]]:
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "none").split(",") if n.strip()]
    exporters: list[tuple[SpanExporter, bool]] = []
    for name in names:
        if name == "none":
            continue
        if name == "console":
            exporters.append((ConsoleSpanExporter(service_name=service), False))
        elif name == "jsonl":
            path = env.get("SPLITSERVE_TRACES_FILE") or DEFAULT_TRACES_FILE
            exporters.append((JsonLinesSpanExporter(path.format(pid=os.getpid(), service=service)), False))
        elif name == "otlp":
            exporters.append((_otlp_exporter(env), True))
        else:
            log.warning("OTEL_TRACES_EXPORTER: unknown exporter %r ignored (known: none, console, otlp, jsonl)", name)
    return exporters


def _otlp_exporter(env) -> SpanExporter:
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    if protocol.strip().lower() in ("http/protobuf", "http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter()
    if protocol.strip().lower() != "grpc":
        log.warning("OTLP protocol %r is not supported; using grpc", protocol)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

    return GrpcExporter()


def span_to_dict(span: ReadableSpan) -> dict:
    """One span as the `jsonl` exporter writes it: ConsoleSpanExporter's fields (ISO times, 0x ids)
    plus exact `start_time_unix_nano` / `end_time_unix_nano`."""
    record = json.loads(span.to_json(indent=None))
    record["start_time_unix_nano"] = span.start_time
    record["end_time_unix_nano"] = span.end_time
    for event, source in zip(record.get("events") or [], span.events, strict=False):
        event["time_unix_nano"] = source.timestamp
    return record


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per span to a file (`splitserve trace report` reads it).

    The file is opened with O_APPEND and each line is one write(), so processes can share it.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            if self._fd < 0:
                return SpanExportResult.FAILURE
            for span in spans:
                os.write(self._fd, (json.dumps(span_to_dict(span), separators=(",", ":")) + "\n").encode())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
