"""Observability of a real local cluster: etcd, control plane, simulated prefill + decode workers,
router and gateway, each its own process exporting spans to a file (OTEL_TRACES_EXPORTER=jsonl).

One streamed request through the real `openai` client must give one trace whose spans come
from >= 4 processes with correct parent/child links; the TTFT phases (plus the measured RPC
hops) must add up to the client-measured TTFT within 5%; every process's /metrics must carry
the named metrics, and they must move as requests run; `X-Splitserve-Timing` must return the
breakdown in the answer."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from splitserve.engine.default_model import default_model_path
from splitserve.telemetry.report import load_traces, render_waterfall, ttft_breakdown
from tests.fixtures.cluster import LocalCluster, wait_for
from tests.fixtures.etcd import free_port

openai = pytest.importorskip("openai")

PROMPT_LEN = 160
SIM = ["--engine", "sim", "--sim-prefill-tokens-per-s", "1000", "--sim-decode-step-s", "0.01", "--block-size", "16"]


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


def _value(text: str, name: str, **labels) -> float:
    """The sample `name{labels}` (labels a subset) of a Prometheus exposition; 0 if absent."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        if metric != name:
            continue
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total += float(value)
    return total


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("observed")
    spans = tmp / "spans"
    env = {"OTEL_TRACES_EXPORTER": "jsonl", "SPLITSERVE_TRACES_FILE": str(spans / "{service}-{pid}.jsonl"),
           "SPLITSERVE_LOG_FORMAT": "json"}  # fmt: skip
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # inherited by every process the fixtures start
    ports = {name: free_port() for name in ("prefill", "decode", "router")}
    workers = [("prefill-worker", [*SIM, "--metrics-port", str(ports["prefill"])]),
               ("decode-worker", [*SIM, "--metrics-port", str(ports["decode"])])]  # fmt: skip
    router_flags = ["--disagg-min-uncached-tokens", "1", "--metrics-port", str(ports["router"])]
    gateway = None
    try:
        model = str(default_model_path())
        with LocalCluster(tmp, model, "tp=1,role=prefill+tp=1,role=decode", workers, router_flags=router_flags) as c:
            gateway_port = free_port()
            log = open(tmp / "gateway.log", "w")  # noqa: SIM115 - closed below
            gateway = subprocess.Popen(
                [sys.executable, "-m", "splitserve", "gateway", "--router", c.router, "--port", str(gateway_port)],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            c.gateway_url = f"http://127.0.0.1:{gateway_port}"
            c.metrics_ports, c.spans_dir = ports, spans

            def healthy():
                with urllib.request.urlopen(c.gateway_url + "/health", timeout=2) as reply:
                    return reply.status == 200

            wait_for(lambda: _quiet(healthy), 60, f"gateway did not start: {(tmp / 'gateway.log').read_text()}")
            yield c
            gateway.terminate()
            gateway.wait(20)
            log.close()
    finally:
        if gateway is not None and gateway.poll() is None:
            gateway.kill()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _quiet(fn):
    try:
        return fn()
    except OSError:
        return False


def _stream_ttft(url: str, prompt: list[int]) -> tuple[float, str]:
    """Client-measured TTFT (request sent -> first token event read) of one streamed completion,
    over a plain HTTP/1.1 connection (so the client adds next to nothing); its trace id."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.connect()
    body = json.dumps({"prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": True, "logprobs": 0})
    started = time.perf_counter()
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    reply = connection.getresponse()
    ttft = None
    for line in reply:
        if ttft is None and line.startswith(b"data: {"):
            ttft = time.perf_counter() - started
    connection.close()
    assert reply.status == 200 and ttft is not None
    return ttft, reply.headers["traceparent"].split("-")[1]


def _spans_of(spans_dir: Path, trace_id: str, want: set[str], timeout_s: float = 15.0):
    """The trace's spans once every span named in `want` has been exported."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = load_traces([spans_dir]).get(trace_id, [])
        if want <= {s.name for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


def test_one_request_is_one_trace_across_processes_and_its_phases_add_up_to_ttft(cluster, tmp_path):
    prompt = [5 + (i * 37) % 3000 for i in range(PROMPT_LEN)]
    _stream_ttft(cluster.gateway_url, [7] * 40)  # warm-up: channels, first-call costs
    client_ttft, trace_id = _stream_ttft(cluster.gateway_url, prompt)

    want = {"POST /v1/completions", "gateway.preprocess", "router.Generate", "router.generate", "router.route",
            "router.prefill", "prefill.request", "prefill.queue", "prefill.compute", "handoff.publish",
            "router.first_token", "gateway.first_chunk", "router.decode", "decode.request", "decode.queue",
            "kv.transfer", "decode.first_step", "decode.stream"}  # fmt: skip
    spans = _spans_of(cluster.spans_dir, trace_id, want)
    by_name = {s.name: s for s in spans}
    assert want <= set(by_name), sorted(want - set(by_name))
    assert {s.trace_id for s in spans} == {trace_id}
    services = {s.service for s in spans}
    assert {"splitserve-gateway", "splitserve-router", "splitserve-prefill-worker", "splitserve-decode-worker"} <= services

    def parent(child: str, of: str) -> None:
        assert by_name[child].parent_id == by_name[of].span_id, f"{child} is not a child of {of}"

    def ancestor(child: str, of: str) -> None:  # FastAPI adds spans of its own in between
        ids = {s.span_id: s for s in spans}
        span = by_name[child]
        while span.parent_id in ids and span.parent_id != by_name[of].span_id:
            span = ids[span.parent_id]
        assert span.parent_id == by_name[of].span_id, f"{child} does not descend from {of}"

    parent("gateway.preprocess", "POST /v1/completions")
    ancestor("router.Generate", "POST /v1/completions")
    parent("router.generate", "router.Generate")  # gateway -> router over gRPC metadata
    parent("router.route", "router.generate")
    parent("router.prefill", "router.generate")
    parent("prefill.request", "router.prefill")  # router -> prefill worker
    for name in ("prefill.queue", "prefill.compute", "handoff.publish"):
        parent(name, "prefill.request")
    parent("decode.request", "router.decode")  # router -> decode worker
    for name in ("decode.queue", "kv.transfer", "decode.first_step", "decode.stream"):
        parent(name, "decode.request")

    route = by_name["router.route"].attributes
    assert route["splitserve.policy"] == "scored" and route["splitserve.disaggregated"] is True
    assert "splitserve.cache.predicted_tokens" in route
    compute = by_name["prefill.compute"].attributes
    assert compute["splitserve.prompt_tokens"] == PROMPT_LEN and compute["splitserve.prefill_chunks"] >= 1
    kv = by_name["kv.transfer"].attributes
    assert kv["splitserve.kv.bytes"] > 0 and kv["splitserve.kv.transport"]  # the sim engine hands off as "inproc"
    assert kv["splitserve.kv.src_layout"].startswith("tp=1,pp=1") and kv["splitserve.kv.dst_layout"]
    assert kv["splitserve.kv.gbps"] == pytest.approx(kv["splitserve.kv.bytes"] / kv["splitserve.kv.seconds"] / 1e9)

    b = ttft_breakdown(spans)
    names = [p.name for p in b.phases]
    assert names[0] == "gateway.preprocess" and names[-1] == "gateway.first_chunk", names
    assert "prefill.compute" in names and "kv.transfer" not in names  # the handoff comes after the first token
    assert abs(b.ttft_ms - client_ttft * 1e3) <= 0.05 * client_ttft * 1e3, (b.ttft_ms, client_ttft)
    assert abs(b.accounted_ms - client_ttft * 1e3) <= 0.05 * client_ttft * 1e3, (names, b.accounted_ms, client_ttft)
    assert render_waterfall(spans, b, tmp_path / "ttft.png").stat().st_size > 10_000


def test_client_traceparent_is_honoured_and_timing_comes_back(cluster):
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    body = json.dumps({"prompt": [9] * 50, "max_tokens": 3, "temperature": 0}).encode()
    request = urllib.request.Request(cluster.gateway_url + "/v1/completions", data=body, headers={
        "Content-Type": "application/json", "traceparent": f"00-{trace_id}-{parent_id}-01", "X-Splitserve-Timing": "1",
    })  # fmt: skip
    with urllib.request.urlopen(request, timeout=30) as reply:
        answer = json.loads(reply.read())
        assert reply.headers["traceparent"].split("-")[1] == trace_id
    timing = answer["splitserve_timing"]
    assert timing["trace_id"] == trace_id
    phases = {p["name"]: p for p in timing["phases"]}
    for name in ("gateway.preprocess", "rpc.router", "router.route", "rpc.prefill", "prefill.queue",
                 "prefill.compute", "handoff.publish", "router.first_token", "kv.transfer"):  # fmt: skip
        assert name in phases, sorted(phases)
    assert not phases["kv.transfer"]["is_ttft"] and phases["prefill.compute"]["is_ttft"]
    assert timing["kv_transfer_bytes"] > 0
    router_ttft = sum(p["ms"] for p in timing["phases"] if p["is_ttft"] and not p["name"].startswith(("gateway", "rpc.router")))
    assert router_ttft == pytest.approx(timing["router_time_to_first_token_ms"], rel=0.05, abs=1.0)
    spans = _spans_of(cluster.spans_dir, trace_id, {"prefill.compute", "POST /v1/completions"})
    root = next(s for s in spans if s.name == "POST /v1/completions")
    assert root.parent_id == parent_id  # the client's span is the gateway span's parent


def test_metrics_endpoints_name_and_move(cluster):
    ports = cluster.metrics_ports
    before = {name: _scrape(port) for name, port in ports.items()}
    gateway_before = urllib.request.urlopen(cluster.gateway_url + "/metrics", timeout=5).read().decode()
    client = openai.OpenAI(base_url=cluster.gateway_url + "/v1", api_key="unused", max_retries=0)
    shared = [11 + i for i in range(64)]
    for i in range(3):  # a shared 64-token prefix: the second and third hit the prefix cache
        client.completions.create(model="splitserve-default", prompt=shared + [100 + i] * 8, max_tokens=4)
    after = {name: _scrape(port) for name, port in ports.items()}
    gateway_after = urllib.request.urlopen(cluster.gateway_url + "/metrics", timeout=5).read().decode()

    r0, r1 = before["router"], after["router"]
    assert _value(r1, "splitserve_router_requests_total", outcome="length") - _value(r0, "splitserve_router_requests_total", outcome="length") == 3
    assert _value(r1, "splitserve_router_decisions_total", policy="scored", mode="disaggregated") >= 3
    assert _value(r1, "splitserve_router_time_to_first_token_seconds_count") - _value(r0, "splitserve_router_time_to_first_token_seconds_count") == 3
    assert _value(r1, "splitserve_router_inter_token_latency_seconds_count") > _value(r0, "splitserve_router_inter_token_latency_seconds_count")
    for name in ("splitserve_router_requests_in_flight", "splitserve_router_rejections_total", "splitserve_router_route_seconds_bucket",
                 "splitserve_router_kv_transfer_bytes_total", "splitserve_router_cached_tokens_total"):  # fmt: skip
        assert name in r1 or name.replace("_total", "") in r1, name

    p0, p1 = before["prefill"], after["prefill"]
    assert _value(p1, "splitserve_worker_requests_total", role="prefill", outcome="handoff") - _value(p0, "splitserve_worker_requests_total", role="prefill", outcome="handoff") == 3
    assert _value(p1, "splitserve_worker_prefix_cache_hits_total", role="prefill") > _value(p0, "splitserve_worker_prefix_cache_hits_total", role="prefill")
    for name in ("splitserve_worker_queue_waiting", "splitserve_worker_queue_running", "splitserve_worker_kv_usage_ratio",
                 "splitserve_worker_pinned_blocks", "splitserve_worker_prefix_cache_hit_rate",
                 "splitserve_worker_queue_seconds_bucket", "splitserve_worker_prefill_seconds_bucket"):  # fmt: skip
        assert any(line.startswith(name + "{") and 'role="prefill"' in line for line in p1.splitlines()), name

    d0, d1 = before["decode"], after["decode"]
    assert _value(d1, "splitserve_worker_kv_transfer_bytes_total", role="decode") > _value(d0, "splitserve_worker_kv_transfer_bytes_total", role="decode")
    assert _value(d1, "splitserve_worker_kv_transfer_seconds_total", role="decode") > _value(d0, "splitserve_worker_kv_transfer_seconds_total", role="decode")
    assert _value(d1, "splitserve_worker_inter_token_latency_seconds_count", role="decode") > _value(d0, "splitserve_worker_inter_token_latency_seconds_count", role="decode")
    assert "splitserve_worker_kv_blocks_used" in d1

    assert _value(gateway_after, "splitserve_gateway_requests_total", endpoint="completions", status="200") - _value(gateway_before, "splitserve_gateway_requests_total", endpoint="completions", status="200") == 3
