"""Connecting to etcd: endpoint parsing and the one place aetcd clients are created."""

from __future__ import annotations

import aetcd


def parse_endpoint(text: str) -> tuple[str, int]:
    """'host:port' (an http:// prefix is tolerated) -> (host, port)."""
    bare = text.removeprefix("http://")
    host, sep, port = bare.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"etcd endpoint must be host:port, got {text!r}")
    return host, int(port)


def connect(endpoint: str, *, timeout_s: float = 5.0) -> aetcd.Client:
    """A client for `endpoint`; it connects lazily on first use.

    The per-call timeout keeps a call from hanging while etcd is unreachable:
    callers retry on aetcd.ClientError instead.
    """
    host, port = parse_endpoint(endpoint)
    return aetcd.Client(host=host, port=port, timeout=timeout_s)
