"""Structured logs that carry the trace id.

    setup_logging("INFO", service="splitserve-router")

Every record gets `trace_id` / `span_id` (of the span current when it was logged; "" outside
a request). SPLITSERVE_LOG_FORMAT picks the shape:

    text (default)  2025-01-01 12:00:00,000 INFO splitserve.router.orchestrator [trace=4bf9…]: message
    json            {"time": ..., "level": "INFO", "logger": ..., "message": ..., "service": ...,
                     "trace_id": ..., "span_id": ..., "request_id": ...}

Prompt text and token ids are never logged unless SPLITSERVE_LOG_PROMPTS=1 (`may_log_prompts()`);
code that would log them asks first.
"""

from __future__ import annotations

import json
import logging
import os
import time

from opentelemetry import trace

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(trace_suffix)s: %(message)s"


def may_log_prompts() -> bool:
    """True only when the operator asked for prompt text in logs (SPLITSERVE_LOG_PROMPTS=1)."""
    return os.environ.get("SPLITSERVE_LOG_PROMPTS", "").strip().lower() in ("1", "true", "yes", "on")


class TraceContextFilter(logging.Filter):
    """Adds `trace_id`, `span_id` and `trace_suffix` (" [trace=…]" or "") to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            record.trace_id = trace.format_trace_id(ctx.trace_id)
            record.span_id = trace.format_span_id(ctx.span_id)
            record.trace_suffix = f" [trace={record.trace_id}]"
        else:
            record.trace_id = record.span_id = record.trace_suffix = ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line; extra fields given with `extra={...}` are kept."""

    _STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "trace_suffix"}

    def __init__(self, service: str = "") -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "service": self.service,
            "trace_id": getattr(record, "trace_id", ""),
            "span_id": getattr(record, "span_id", ""),
        }
        for key, value in vars(record).items():
            if key not in self._STANDARD and key not in entry:
                entry[key] = value if isinstance(value, str | int | float | bool | type(None)) else repr(value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, separators=(",", ":"))


def setup_logging(level: str | int = "INFO", service: str = "", fmt: str | None = None) -> None:
    """Configures the root logger once (like logging.basicConfig) with the trace-id filter;
    `fmt` ("text" | "json") defaults to SPLITSERVE_LOG_FORMAT, else text."""
    fmt = (fmt or os.environ.get("SPLITSERVE_LOG_FORMAT") or "text").strip().lower()
    handler = logging.StreamHandler()
    handler.addFilter(TraceContextFilter())
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else logging.Formatter(_TEXT_FORMAT))
    root = logging.getLogger()
    if any(getattr(h, "_splitserve", False) for h in root.handlers):
        return
    handler._splitserve = True  # type: ignore[attr-defined]
    for old in [h for h in root.handlers if isinstance(h, logging.StreamHandler)]:
        root.removeHandler(old)  # a basicConfig from before: ours replaces it
    root.addHandler(handler)
    root.setLevel(level)
