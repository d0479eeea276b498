"""splitserve.telemetry: traces, metrics and logs shared by every process (torch-free).

    tracing.py      TracerProvider from OTEL_* variables; the `jsonl` file exporter
    propagation.py  W3C traceparent in gRPC metadata and HTTP headers
    spans.py        server / client spans, spans over measured intervals, TTFT attributes
    metrics.py      Prometheus registries of the gRPC processes, /metrics on --metrics-port
    logs.py         structured logs carrying the trace id; prompts stay out of them
    http.py         the gateway's ASGI middleware (request span, client traceparent)
    report.py       spans -> TTFT breakdown table + PNG waterfall (`splitserve trace report`)

`init_process(service, log_level)` is what a process calls at start.
"""

from __future__ import annotations

from splitserve.telemetry.logs import setup_logging
from splitserve.telemetry.tracing import setup_tracing


def init_process(service: str, log_level: str | int = "INFO") -> None:
    """Tracing from OTEL_* variables and trace-id-carrying logs, for a process named `service`."""
    setup_tracing(service)
    setup_logging(log_level, service=service)


__all__ = ["init_process", "setup_logging", "setup_tracing"]
