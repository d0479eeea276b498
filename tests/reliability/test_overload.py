"""Overload: a bounded ramp past capacity against a real `splitserve up` cluster (the embedded model).

Closed-loop clients ramp from under capacity to 8x the router's --max-in-flight (the gateway's is
twice that, so both refuse: the gateway before reading a body, the router with RESOURCE_EXHAUSTED,
answered 429 by the gateway). Guarantees:
every answer is 200 or 429, every 429 carries Retry-After, the router never runs more than
--max-in-flight requests (its in-flight gauge, sampled), accepted throughput at 8x holds at
least HOLD_FRACTION of what it was at capacity, and no process's RSS grows by more than 40 MB from the
first level to the last. Numbers are printed (pytest -s) for benchmarks/RESULTS.md."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import urllib.request

import pytest

from splitserve.readiness import free_port
from tests.e2e.process_tree import descendants
from tests.reliability.overload_load import command_line, rss_mb, run_level
from tests.security.up_cluster import UpCluster

if shutil.which("etcd") is None:
    pytest.skip("needs the etcd binary (apt-get install etcd-server)", allow_module_level=True)

MAX_IN_FLIGHT = 16
GATEWAY_MAX_IN_FLIGHT = 2 * MAX_IN_FLIGHT
"""Past it the gateway refuses before reading the body; between the two the router refuses."""
LEVELS = (4, 16, 64, 128)
SECONDS_PER_LEVEL = 8.0
BODY = {"prompt": "def fib(n):", "max_tokens": 16}
RSS_GROWTH_LIMIT_MB = 40.0
HOLD_FRACTION = 0.6
"""Accepted throughput at 8x load over that at capacity. Refusals cost the 2-core test machine's CPU too
(the load generator runs on it), so this leaves room for that."""
ENGINE_FLAGS = os.environ.get("SPLITSERVE_OVERLOAD_ENGINE_FLAGS", "--engine torch").split()
"""The embedded model by default; e.g. "--engine sim --worker-arg=--sim-decode-step-s=0.05" for modelled workers."""



def _router_in_flight(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=2).read().decode()
    return float(re.search(r"^splitserve_router_requests_in_flight (\S+)$", text, re.M).group(1))


async def _sample_in_flight(metrics_url: str, samples: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append(await asyncio.to_thread(_router_in_flight, metrics_url))
        await asyncio.sleep(0.1)


def _processes(up: UpCluster) -> dict[str, int]:
    found = {}
    for pid in descendants(up.proc.pid):
        line = command_line(pid)
        for name in ("gateway", "router", "prefill-worker", "decode-worker", "control-plane"):
            if f"splitserve {name}" in line:
                found[name] = pid
    return found


@pytest.mark.slow
async def test_ramp_past_capacity_is_refused_with_429_and_throughput_holds(tmp_path):
    metrics_port = free_port()
    flags = [*ENGINE_FLAGS, f"--router-arg=--max-in-flight={MAX_IN_FLIGHT}",
             f"--router-arg=--metrics-port={metrics_port}", f"--gateway-arg=--max-in-flight={GATEWAY_MAX_IN_FLIGHT}"]  # fmt: skip
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    with UpCluster(tmp_path / "up", *flags) as up:
        pids = _processes(up)
        assert {"gateway", "router", "prefill-worker", "decode-worker"} <= set(pids), pids
        results, rss, peaks = [], [], []
        for num_clients in LEVELS:
            samples: list[float] = []
            stop = asyncio.Event()
            sampler = asyncio.create_task(_sample_in_flight(metrics_url, samples, stop))
            results.append(await run_level(up.url, num_clients, SECONDS_PER_LEVEL, BODY))
            stop.set()
            await sampler
            peaks.append(max(samples))
            rss.append({name: rss_mb(pid) for name, pid in pids.items()})
        for r, peak, mem in zip(results, peaks, rss, strict=True):
            print(f"clients={r.num_clients:4d} accepted/s={r.accepted_per_s:6.1f} 200={r.statuses[200]:5d} "
                  f"429={r.statuses[429]:6d} (gateway {r.refused_by_gateway}) other={sum(v for k, v in r.statuses.items() if k not in (200, 429))} "
                  f"p50={r.p(0.5) * 1000:6.0f} ms p99={r.p(0.99) * 1000:6.0f} ms router_in_flight_max={peak:.0f} "
                  + " ".join(f"{k}={v:.0f}MB" for k, v in mem.items()))  # fmt: skip
        for r, peak in zip(results, peaks, strict=True):
            assert set(r.statuses) <= {200, 429}, r.statuses
            assert r.missing_retry_after == 0
            assert peak <= MAX_IN_FLIGHT
        at_capacity, top = results[1], results[-1]
        assert top.statuses[200] > 0 and top.refused_by_gateway > 0 and top.statuses[429] > top.refused_by_gateway
        assert top.accepted_per_s >= HOLD_FRACTION * at_capacity.accepted_per_s, (top.accepted_per_s, at_capacity.accepted_per_s)
        for name in rss[0]:
            assert rss[-1][name] - rss[0][name] <= RSS_GROWTH_LIMIT_MB, (name, rss[0][name], rss[-1][name])
        assert up.stop() == 0
