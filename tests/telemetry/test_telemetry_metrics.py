"""/metrics of the gRPC processes: served over HTTP on their own port, engine state read live,
control-plane state, and the router's counters moving with requests (real orchestrator, doubles
for the workers)."""

from __future__ import annotations

import urllib.request

import pytest

from splitserve.engine.block_pool import BlockPool
from splitserve.engine.config import SchedulerConfig
from splitserve.engine.scheduler import Scheduler
from splitserve.telemetry.metrics import (
    ControlPlaneMetrics,
    MetricsServer,
    RouterMetrics,
    WorkerMetrics,
    start_metrics_server,
)


def _scrape(server: MetricsServer) -> str:
    with urllib.request.urlopen(f"http://{server.address}/metrics", timeout=5) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        return reply.read().decode()


class _Engine:
    """What EngineCollector reads of an engine: the real pool and scheduler, and the pin count."""

    def __init__(self) -> None:
        self.pool = BlockPool(10)
        self.scheduler = Scheduler(SchedulerConfig(), self.pool, 16)
        self.num_pinned_blocks = 0


def test_worker_metrics_read_the_engine_at_scrape_time():
    engine = _Engine()
    metrics = WorkerMetrics("prefill", engine)
    server = MetricsServer(metrics.registry, 0)  # a free port (start_metrics_server takes 0 as "off")
    server.start()
    try:
        assert server.host == "127.0.0.1"
        text = _scrape(server)
        assert 'splitserve_worker_kv_blocks_total{role="prefill"} 10.0' in text
        assert 'splitserve_worker_kv_usage_ratio{role="prefill"} 0.0' in text
        engine.pool.allocate(4)
        engine.num_pinned_blocks = 3
        engine.pool.num_queries, engine.pool.num_hits = 8, 2
        metrics.requests.labels("prefill", "handoff").inc()
        text = _scrape(server)
        assert 'splitserve_worker_kv_blocks_used{role="prefill"} 4.0' in text
        assert 'splitserve_worker_kv_usage_ratio{role="prefill"} 0.4' in text
        assert 'splitserve_worker_pinned_blocks{role="prefill"} 3.0' in text
        assert 'splitserve_worker_prefix_cache_hit_rate{role="prefill"} 0.25' in text
        assert 'splitserve_worker_prefix_cache_hits_total{role="prefill"} 2.0' in text
        assert 'splitserve_worker_requests_total{outcome="handoff",role="prefill"} 1.0' in text
        assert 'splitserve_worker_queue_waiting{role="prefill"} 0.0' in text
    finally:
        server.stop()


def test_metrics_port_zero_is_off_and_a_taken_port_is_an_error():
    registry = RouterMetrics().registry
    assert start_metrics_server(registry, 0) is None and start_metrics_server(registry, None) is None
    first = MetricsServer(registry, 0)
    first.start()
    try:
        with pytest.raises(OSError):
            start_metrics_server(registry, first.port)
    finally:
        first.stop()


def test_control_plane_metrics():
    state = {"value": None}
    server = MetricsServer(ControlPlaneMetrics(lambda: state["value"]).registry, 0)
    server.start()
    try:
        assert "splitserve_control_plane_slots" not in _scrape(server)  # before the first topology
        state["value"] = (True, 4, 3, 3)
        text = _scrape(server)
        assert "splitserve_control_plane_is_leader 1.0" in text and "splitserve_control_plane_slots_filled 3.0" in text
    finally:
        server.stop()
