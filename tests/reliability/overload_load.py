"""Closed-loop HTTP load for overload tests: N clients post completions for a while, and what came back.

Raw asyncio HTTP/1.1 (one connection per request) so that thousands of refusals cost the client
little; a refused client waits as Retry-After says and tries again, keeping the pressure on.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit


@dataclass
class LevelResult:
    num_clients: int
    seconds: float
    statuses: Counter = field(default_factory=Counter)
    latencies_s: list[float] = field(default_factory=list)
    """Of accepted (200) requests."""
    missing_retry_after: int = 0
    """429 answers without a Retry-After header."""
    refused_by_gateway: int = 0
    """429 answers from the gateway's own bound (the rest came from the router's RESOURCE_EXHAUSTED)."""

    @property
    def accepted_per_s(self) -> float:
        return self.statuses[200] / self.seconds

    def p(self, q: float) -> float:
        values = sorted(self.latencies_s)
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def post(url: str, path: str, body: dict, timeout_s: float = 60.0) -> tuple[int, dict[str, str], bytes]:
    parts = urlsplit(url)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, parts.port), timeout_s)
    try:
        data = json.dumps(body).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)  # fmt: skip
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()
    head_bytes, _, payload = raw.partition(b"\r\n\r\n")
    head = head_bytes.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
    return int(head[0].split()[1]), headers, payload


async def run_level(url: str, num_clients: int, seconds: float, body: dict) -> LevelResult:
    """`seconds` of load; the result's `seconds` also counts the tail (requests still running at the end).
    A refused client waits what Retry-After says (with jitter), as a well-behaved client does."""
    result = LevelResult(num_clients, seconds)
    begin = time.monotonic()
    end = begin + seconds

    async def client() -> None:
        while time.monotonic() < end:
            started = time.monotonic()
            try:
                status, headers, payload = await post(url, "/v1/completions", body)
            except (OSError, TimeoutError, IndexError, ValueError):
                status, headers, payload = -1, {}, b""
            result.statuses[status] += 1
            if status == 200:
                result.latencies_s.append(time.monotonic() - started)
            elif status == 429:
                result.missing_retry_after += "retry-after" not in headers
                result.refused_by_gateway += b"gateway is at capacity" in payload
                await asyncio.sleep(float(headers.get("retry-after", "1")) * random.uniform(0.5, 1.0))

    await asyncio.gather(*(client() for _ in range(num_clients)))
    result.seconds = time.monotonic() - begin
    return result


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
