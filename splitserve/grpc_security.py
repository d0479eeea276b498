"""Transport security and message limits of every gRPC hop: one place makes servers and channels.

    gateway ─▶ router ─▶ prefill / decode workers ◀─▶ (decode pulls / acks the prefill worker)
       SDK ─▶ router ─▶ control plane ◀─ workers

Each process has one identity (`TLSFiles.cert` / `key`, served to clients and, with mutual
TLS, presented to servers) and one CA bundle (`TLSFiles.ca`) that verifies its peers. With
`client_auth`, servers refuse clients without a certificate signed by that CA; so a
plaintext client, or one trusting another CA, never gets a call through.

The CLI (splitserve/cli.py) sets the process's `GrpcSecurity` once, from --tls-* flags,
SPLITSERVE_TLS_* variables or --config; code that makes a server or channel calls
`aio_server()` / `add_port()` / `aio_channel()` / `sync_channel()`, which use it unless
given another (tests pass one explicitly).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpc

DEFAULT_MAX_MESSAGE_BYTES = 16 << 20
"""Largest gRPC message sent or received (grpc's own default receive limit is 4 MiB, send unlimited).
16 MiB holds a 2M-block GetBlockSet answer and any prompt the gateway admits."""


@dataclass(frozen=True)
class TLSFiles:
    """PEM files of one process's TLS identity and trust."""

    cert: Path | None = None
    """Certificate chain of this process: served by its gRPC servers, presented as client certificate."""
    key: Path | None = None
    """Private key of `cert`."""
    ca: Path | None = None
    """CA bundle that verifies peers (servers this process calls; clients, with client_auth).
    None: the system's roots for servers; client_auth then needs one."""
    client_auth: bool = False
    """Mutual TLS: servers require a client certificate signed by `ca`; channels present `cert`."""

    def __post_init__(self) -> None:
        for name in ("cert", "key", "ca"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, Path(value))
                if not Path(value).is_file():
                    raise ValueError(f"--tls-{name}: {str(value)!r} is not a readable file")
        if (self.cert is None) != (self.key is None):
            raise ValueError(f"--tls-cert and --tls-key go together, got cert={self.cert!r} and key={self.key!r}")
        if self.client_auth and self.ca is None:
            raise ValueError("--tls-client-auth needs --tls-ca (the CA that signs client certificates)")
        if self.client_auth and self.cert is None:
            raise ValueError("--tls-client-auth needs --tls-cert/--tls-key (this process's own certificate)")

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert is None or self.key is None:
            raise ValueError("serving TLS needs --tls-cert and --tls-key")
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=self.ca.read_bytes() if self.ca is not None else None,
            require_client_auth=self.client_auth,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        present = self.cert is not None and self.key is not None
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes() if self.ca is not None else None,
            private_key=self.key.read_bytes() if present else None,
            certificate_chain=self.cert.read_bytes() if present else None,
        )


@dataclass(frozen=True)
class GrpcSecurity:
    """How this process's gRPC servers listen and its channels connect."""

    tls: TLSFiles | None = None
    """None: plaintext (loopback / trusted networks only)."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest message sent or received; a larger one fails with RESOURCE_EXHAUSTED."""
    channel_options: tuple[tuple[str, object], ...] = field(default_factory=tuple)
    """Extra channel arguments (tests: ("grpc.ssl_target_name_override", "localhost"))."""

    def __post_init__(self) -> None:
        if isinstance(self.max_message_bytes, bool) or not isinstance(self.max_message_bytes, int) \
                or self.max_message_bytes < 1024:  # fmt: skip
            raise ValueError(f"max_message_bytes must be an integer >= 1024, got {self.max_message_bytes!r}")

    def options(self) -> list[tuple[str, object]]:
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            *self.channel_options,
        ]


_process_security = GrpcSecurity()


def configure(security: GrpcSecurity) -> None:
    """Sets this process's security (the CLI, once, before any server or channel is made)."""
    global _process_security
    _process_security = security


def current() -> GrpcSecurity:
    return _process_security


def aio_server(options: list[tuple[str, object]] | None = None, security: GrpcSecurity | None = None) -> grpc.aio.Server:
    """A grpc.aio server with the message limits (and `options`)."""
    security = security or _process_security
    return grpc.aio.server(options=[*security.options(), *(options or [])])


def add_port(server: grpc.aio.Server | grpc.Server, listen: str, security: GrpcSecurity | None = None) -> int:
    """Binds `listen` with TLS when configured, else plaintext; returns the port (0: could not bind)."""
    security = security or _process_security
    if security.tls is None:
        return server.add_insecure_port(listen)
    return server.add_secure_port(listen, security.tls.server_credentials())


def aio_channel(
    address: str, security: GrpcSecurity | None = None, options: list[tuple[str, object]] | None = None
) -> grpc.aio.Channel:
    security = security or _process_security
    opts = [*security.options(), *(options or [])]
    if security.tls is None:
        return grpc.aio.insecure_channel(address, opts)
    return grpc.aio.secure_channel(address, security.tls.channel_credentials(), opts)


def sync_channel(
    address: str, security: GrpcSecurity | None = None, options: list[tuple[str, object]] | None = None
) -> grpc.Channel:
    security = security or _process_security
    opts = [*security.options(), *(options or [])]
    if security.tls is None:
        return grpc.insecure_channel(address, opts)
    return grpc.secure_channel(address, security.tls.channel_credentials(), opts)
