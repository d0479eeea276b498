"""The gateway's own bound (--max-in-flight): past it, 429 + Retry-After before the body is read;
finished, failed and abandoned requests (streams included) give their place back."""

from __future__ import annotations

import http.client
import json
import threading
import time
from urllib.parse import urlsplit

from splitserve.gateway.config import GatewayConfig
from tests.fixtures.gateway_server import running_gateway
from tests.gateway.http_helpers import post


def _open_stream(url: str) -> http.client.HTTPConnection:
    """Starts a slow streaming completion and reads its first event; the caller closes it."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    body = json.dumps({"prompt": "SLOW", "max_tokens": 400, "stream": True})
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    response.fp.readline()
    return conn


def test_requests_past_max_in_flight_get_429_and_places_come_back(router):
    with running_gateway(GatewayConfig(router=router.address, max_in_flight=2)) as url:
        streams = [_open_stream(url), _open_stream(url)]
        status, body, headers = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 429 and body["error"]["code"] == "overloaded" and headers["retry-after"] == "1"
        for conn in streams:  # clients that leave mid-stream free their place
            conn.close()
        deadline = time.monotonic() + 10
        while post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] != 200:
            assert time.monotonic() < deadline, "the gateway kept the abandoned streams' places"
            time.sleep(0.05)
        results = []
        threads = [threading.Thread(target=lambda: results.append(post(url, "/v1/completions",
                                                                       {"prompt": "x", "max_tokens": 4})[0]))
                   for _ in range(6)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert set(results) <= {200, 429} and 200 in results
        assert [post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] for _ in range(3)] == [200] * 3
