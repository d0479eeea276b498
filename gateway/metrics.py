"""Prometheus metrics of one gateway (its own registry, so several gateways can live in one process)."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "splitserve_gateway_requests", "HTTP requests answered, by endpoint and status code",
            ["endpoint", "status"], registry=r,
        )  # fmt: skip
        self.running = Gauge("splitserve_gateway_requests_running", "Generation requests in progress", registry=r)
        self.request_seconds = Histogram(
            "splitserve_gateway_request_seconds", "Time from request to the last byte of a generation answer",
            ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft_seconds = Histogram(
            "splitserve_gateway_time_to_first_token_seconds", "Time from request to the first generated token",
            ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter("splitserve_gateway_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter(
            "splitserve_gateway_completion_tokens", "Generated tokens of finished requests", registry=r
        )
        self.cached_tokens = Counter(
            "splitserve_gateway_cached_prompt_tokens", "Prompt tokens served from a prefix cache", registry=r
        )
        self.disconnects = Counter(
            "splitserve_gateway_client_disconnects", "Requests cancelled because the client went away", registry=r
        )

    def record_usage(self, usage: dict) -> None:
        self.prompt_tokens.inc(usage["prompt_tokens"])
        self.completion_tokens.inc(usage["completion_tokens"])
        self.cached_tokens.inc(usage["prompt_tokens_details"]["cached_tokens"])

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
