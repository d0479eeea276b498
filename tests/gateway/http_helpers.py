"""Raw HTTP against a gateway (bytes in, status + JSON out), for requests no well-behaved client sends."""

import http.client
import json
from urllib.parse import urlsplit


def request(url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        data = response.read()
        try:
            payload = json.loads(data)
        except ValueError:
            payload = data.decode("utf-8", "replace")
        return response.status, payload, dict(response.getheaders())
    finally:
        conn.close()


def post(url: str, path: str, body, headers: dict | None = None):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return request(url, "POST", path, raw, headers)
