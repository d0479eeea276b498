"""A client that goes away cancels its request downstream: the gateway cancels the router call (the real
router then aborts the request on every worker), for streamed and whole answers alike."""

import json
import socket
import time
from urllib.parse import urlsplit

import pytest

from tests.gateway.http_helpers import request


def _open(gateway, body: dict) -> socket.socket:
    parts = urlsplit(gateway)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    raw = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))  # fmt: skip
    return sock


def _wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def _disconnects(gateway) -> float:
    _, text, _ = request(gateway, "GET", "/metrics")
    line = next(x for x in text.splitlines() if x.startswith("splitserve_gateway_client_disconnects_total"))
    return float(line.split()[1])


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_the_router_call(gateway, router, stream):
    before = _disconnects(gateway)
    sock = _open(gateway, {"prompt": "SLOW please", "max_tokens": 500, "stream": stream})
    assert _wait_for(lambda: router.record.requests and "SLOW" in router.tokenizer.decode(
        list(router.record.requests[-1].token_ids)))  # fmt: skip
    request_id = router.record.requests[-1].request_id
    if stream:
        head = sock.recv(65536)
        assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
    else:
        time.sleep(0.2)
    sock.close()
    started = time.monotonic()
    assert _wait_for(lambda: request_id in router.record.cancelled, 5), "the router call was not cancelled"
    assert time.monotonic() - started < 5
    assert _wait_for(lambda: _disconnects(gateway) == before + 1, 5)
