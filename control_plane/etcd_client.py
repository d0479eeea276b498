"""Connecting to etcd: endpoint parsing, credentials, and the one place aetcd clients are created.

etcd authentication (`--etcd-user` / `--etcd-password`: the client authenticates on connect,
sends the token with every call, and authenticates again when etcd no longer knows the token) and TLS (`--etcd-ca`, with `--etcd-cert` / `--etcd-key` for
an etcd started with --client-cert-auth) come from `EtcdOptions`, set once per process by
the CLI (`configure`) or passed to `connect`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import aetcd
import grpc

from splitserve.control_plane.etcd_secure_client import SecureClient


@dataclass(frozen=True)
class EtcdOptions:
    """Credentials for etcd; all None = plaintext, no authentication."""

    user: str | None = None
    """etcd user name (with `password`): etcd's auth must be enabled with this user."""
    password: str | None = None
    """Password of `user`; prefer SPLITSERVE_ETCD_PASSWORD or --config over the flag (`ps` shows flags)."""
    ca: Path | None = None
    """CA bundle that verifies etcd's server certificate; set = connect over TLS."""
    cert: Path | None = None
    """Client certificate for etcd's --client-cert-auth (with `key`)."""
    key: Path | None = None
    """Private key of `cert`."""

    def __post_init__(self) -> None:
        if (self.user is None) != (self.password is None):
            raise ValueError("--etcd-user and --etcd-password go together, got only one")
        if self.user == "":
            raise ValueError("--etcd-user may not be empty")
        for name in ("ca", "cert", "key"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, Path(value))
                if not Path(value).is_file():
                    raise ValueError(f"--etcd-{name}: {str(value)!r} is not a readable file")
        if (self.cert is None) != (self.key is None):
            raise ValueError("--etcd-cert and --etcd-key go together, got only one")
        if self.cert is not None and self.ca is None:
            raise ValueError("--etcd-cert needs --etcd-ca (client certificates are only sent over TLS)")

    @property
    def is_tls(self) -> bool:
        return self.ca is not None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes() if self.ca else None,
            private_key=self.key.read_bytes() if self.key else None,
            certificate_chain=self.cert.read_bytes() if self.cert else None,
        )


_process_options = EtcdOptions()


def configure(options: EtcdOptions) -> None:
    """Sets this process's etcd credentials (the CLI, once, before any client is made)."""
    global _process_options
    _process_options = options


def current() -> EtcdOptions:
    return _process_options


def parse_endpoint(text: str) -> tuple[str, int]:
    """'host:port' (an http:// or https:// prefix is tolerated) -> (host, port)."""
    bare = text.removeprefix("http://").removeprefix("https://")
    host, sep, port = bare.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"etcd endpoint must be host:port, got {text!r}")
    return host, int(port)


class EtcdUnavailableError(ConnectionError):
    """etcd could not be reached (or refused us) where a process cannot go on without it, such as
    a worker's first registration: the message names the endpoint, for a one-line error."""


def connect(endpoint: str, *, timeout_s: float = 5.0, options: EtcdOptions | None = None) -> aetcd.Client:
    """A client for `endpoint`; it connects (and authenticates) lazily on first use.

    The per-call timeout keeps a call from hanging while etcd is unreachable:
    callers retry on aetcd.ClientError instead.
    """
    options = options or _process_options
    host, port = parse_endpoint(endpoint)
    kwargs = dict(host=host, port=port, username=options.user, password=options.password, timeout=timeout_s)
    if options.is_tls or options.user is not None:
        return SecureClient(options.credentials() if options.is_tls else None, **kwargs)
    return aetcd.Client(**kwargs)
