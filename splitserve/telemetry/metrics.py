"""Prometheus metrics of the gRPC processes (router, prefill / decode workers, control plane),
each on its own registry, served over HTTP on a separate port (`--metrics-port`).

    metrics = RouterMetrics()
    server = MetricsServer(metrics.registry, port=9100)   # 127.0.0.1 unless told otherwise
    server.start(); ...; server.stop()

Names follow Prometheus conventions (`_seconds`, `_bytes`, counters end in `_total` on the
wire). The gateway keeps its own metrics (gateway/metrics.py) on its HTTP port.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5)
BYTES_BUCKETS = tuple(float(1 << k) for k in range(16, 34, 2))  # 64 KiB .. 8 GiB


class RouterMetrics:
    """What a router counts (the orchestrator updates these; one event loop)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("splitserve_router_requests", "Generate requests, by outcome (finish reason or error)",
                                ["outcome"], registry=r)  # fmt: skip
        self.in_flight = Gauge("splitserve_router_requests_in_flight", "Generate requests running now", registry=r)
        self.rejections = Counter("splitserve_router_rejections", "Requests refused before any work, by reason",
                                  ["reason"], registry=r)  # fmt: skip
        self.decisions = Counter("splitserve_router_decisions", "Routing decisions, by policy and mode",
                                 ["policy", "mode"], registry=r)  # fmt: skip
        self.retries = Counter("splitserve_router_retries", "Worker calls retried elsewhere, by stage",
                               ["stage"], registry=r)  # fmt: skip
        self.prefetches = Counter("splitserve_router_prefetches",
                                  "Layer-wise handoff previews sent to DecodeWorker.Prefetch, by answer",
                                  ["answer"], registry=r)  # fmt: skip
        self.route_seconds = Histogram("splitserve_router_route_seconds", "Time to decide a route",
                                       buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.ttft_seconds = Histogram("splitserve_router_time_to_first_token_seconds",
                                      "Request arrival at the router to its first token sent", buckets=LATENCY_BUCKETS,
                                      registry=r)  # fmt: skip
        self.itl_seconds = Histogram("splitserve_router_inter_token_latency_seconds",
                                     "Time between consecutive output chunks of a request, per token",
                                     buckets=ITL_BUCKETS, registry=r)  # fmt: skip
        self.prompt_tokens = Counter("splitserve_router_prompt_tokens", "Prompt tokens of routed requests", registry=r)
        self.predicted_cached_tokens = Counter("splitserve_router_predicted_cached_tokens",
                                               "Prompt tokens the router expected a worker to have cached",
                                               registry=r)  # fmt: skip
        self.cached_tokens = Counter("splitserve_router_cached_tokens",
                                     "Prompt tokens the workers actually served from their prefix caches",
                                     registry=r)  # fmt: skip
        self.transfer_bytes = Counter("splitserve_router_kv_transfer_bytes",
                                      "KV bytes decode workers pulled for this router's handoffs", registry=r)  # fmt: skip


class WorkerMetrics:
    """A prefill or decode worker's metrics; `engine` is read live at each scrape (queue depths,
    KV usage, prefix-cache counters, pins)."""

    def __init__(self, role: str, engine=None) -> None:
        self.role = role
        self.registry = r = CollectorRegistry()
        labels = ["role"]
        self.requests = Counter("splitserve_worker_requests", "Requests served, by outcome", ["role", "outcome"],
                                registry=r)  # fmt: skip
        self.queue_seconds = Histogram("splitserve_worker_queue_seconds",
                                       "Call arrival to the request's first engine step (or KV import)", labels,
                                       buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.prefill_seconds = Histogram("splitserve_worker_prefill_seconds",
                                         "First prompt chunk to first token (all chunks)", labels,
                                         buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.ttft_seconds = Histogram("splitserve_worker_time_to_first_token_seconds",
                                      "Call arrival to the first token this worker produced", labels,
                                      buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.itl_seconds = Histogram("splitserve_worker_inter_token_latency_seconds",
                                     "Time between consecutive streamed tokens (decode)", labels,
                                     buckets=ITL_BUCKETS, registry=r)  # fmt: skip
        self.transfer_bytes = Counter("splitserve_worker_kv_transfer_bytes", "KV bytes imported over a handoff",
                                      ["role", "transport"], registry=r)  # fmt: skip
        self.transfer_seconds = Counter("splitserve_worker_kv_transfer_seconds",
                                        "Seconds the transport spent moving imported KV", ["role", "transport"],
                                        registry=r)  # fmt: skip
        self.transfer_size = Histogram("splitserve_worker_kv_transfer_size_bytes", "KV bytes of one handoff import",
                                       ["role", "transport"], buckets=BYTES_BUCKETS, registry=r)  # fmt: skip
        self.transfer_failures = Counter("splitserve_worker_kv_transfer_failures", "Handoff imports that failed",
                                         labels, registry=r)  # fmt: skip
        self.handoffs = Counter("splitserve_worker_handoffs", "Handoffs published (prefill, blocks pinned)",
                                labels, registry=r)  # fmt: skip
        self.rejections = Counter("splitserve_worker_rejections", "Requests refused, by reason",
                                  ["role", "reason"], registry=r)  # fmt: skip
        if engine is not None:
            r.register(EngineCollector(role, lambda: engine))


class EngineCollector(Collector):
    """Gauges and counters read from an engine at scrape time (plain attribute reads: no locks,
    possibly a step apart from each other, never torn)."""

    def __init__(self, role: str, engine: Callable[[], object]) -> None:
        self.role = role
        self.engine = engine

    def collect(self):
        engine = self.engine()
        role = [self.role]
        pool, scheduler = engine.pool, engine.scheduler

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["role"])
            family.add_metric(role, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["role"])
            family.add_metric(role, value)
            return family

        num_used = pool.num_blocks - pool.num_available
        yield gauge("splitserve_worker_queue_waiting", "Requests waiting for their first engine step", len(scheduler.waiting))
        yield gauge("splitserve_worker_queue_running", "Requests in the running batch", len(scheduler.running))
        yield gauge("splitserve_worker_kv_blocks_total", "KV blocks of the pool", pool.num_blocks)
        yield gauge("splitserve_worker_kv_blocks_used", "KV blocks held by requests or pins", num_used)
        yield gauge("splitserve_worker_kv_usage_ratio", "Fraction of the KV pool held by requests or pins",
                    num_used / pool.num_blocks if pool.num_blocks else 0.0)  # fmt: skip
        yield gauge("splitserve_worker_pinned_blocks", "KV blocks pinned for a decode peer's pull", engine.num_pinned_blocks)
        queries, hits = pool.num_queries, pool.num_hits
        yield counter("splitserve_worker_prefix_cache_queries", "Prompt blocks looked up in the prefix cache", queries)
        yield counter("splitserve_worker_prefix_cache_hits", "Prompt blocks found in the prefix cache", hits)
        yield gauge("splitserve_worker_prefix_cache_hit_rate", "Prefix-cache hits / lookups since start",
                    hits / queries if queries else 0.0)  # fmt: skip


class ControlPlaneMetrics:
    """A control-plane replica's view, read at scrape time: leadership, slots, registered workers.

    `state()` returns (is_leader, num_slots, num_filled_slots, num_workers), or None before the
    first topology."""

    def __init__(self, state: Callable[[], tuple[bool, int, int, int] | None]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_ControlPlaneCollector(state))


class _ControlPlaneCollector(Collector):
    def __init__(self, state) -> None:
        self.state = state

    def collect(self):
        state = self.state()
        if state is None:
            return
        names = ("is_leader", "slots", "slots_filled", "workers")
        docs = ("1 while this replica leads", "Rank slots of --inference-shards", "Slots a worker fills",
                "Registered workers")  # fmt: skip
        for name, doc, value in zip(names, docs, state, strict=True):
            yield GaugeMetricFamily(f"splitserve_control_plane_{name}", doc, value=float(value))


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass


class MetricsServer:
    """`GET /metrics` (any path, in fact) of one registry, on a daemon thread."""

    def __init__(self, registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> None:
        self.registry = registry
        self.host = host
        self.port = port
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> str:
        """Binds (port 0 picks a free one) and serves; returns HOST:PORT. OSError if the port is taken."""
        self._server = make_server(self.host, self.port, make_wsgi_app(self.registry), handler_class=_QuietHandler)
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()
        return self.address

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def start_metrics_server(registry: CollectorRegistry, port: int | None, host: str = "127.0.0.1") -> MetricsServer | None:
    """A started MetricsServer, or None when `port` is None or 0 (disabled)."""
    if not port:
        return None
    server = MetricsServer(registry, port, host)
    server.start()
    return server


def add_metrics_arguments(parser) -> None:
    """`--metrics-port` / `--metrics-host` of a gRPC process (env SPLITSERVE_METRICS_PORT / _HOST, via
    splitserve.config_sources like every option)."""
    parser.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                        help="serve Prometheus /metrics over HTTP on this port; 0 = off (default %(default)s)")
    parser.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                        help="bind address of /metrics (default %(default)s)")
