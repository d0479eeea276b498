"""Connection options of the SDK: deadlines, retries with backoff, TLS."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import grpc


def _read(value: bytes | str | Path | None) -> bytes | None:
    """PEM bytes as given, or read from a path."""
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


@dataclass(frozen=True)
class TLSConfig:
    """TLS for the router / control-plane channels; PEM bytes or file paths."""

    root_certificates: bytes | str | Path | None = None
    """CA bundle to verify the server; None uses the system's roots."""
    private_key: bytes | str | Path | None = None
    """Client key, for mutual TLS (with certificate_chain)."""
    certificate_chain: bytes | str | Path | None = None
    """Client certificate chain, for mutual TLS (with private_key)."""
    server_name_override: str | None = None
    """Expect this name in the server certificate instead of the host (tests, IP addresses)."""

    def __post_init__(self) -> None:
        if (self.private_key is None) != (self.certificate_chain is None):
            raise ValueError("mutual TLS needs both private_key and certificate_chain, got only one")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            _read(self.root_certificates), _read(self.private_key), _read(self.certificate_chain)
        )


@dataclass(frozen=True)
class ClientOptions:
    """How the SDK calls the cluster. Every field is validated; errors quote the value."""

    timeout_s: float | None = 600.0
    """Default deadline of one Generate call (the whole stream); None = none."""
    control_timeout_s: float = 10.0
    """Deadline of short calls (Abort, lifecycle, topology)."""
    max_attempts: int = 3
    """Tries of a call that fails with UNAVAILABLE (1 = no retry); a try that broke after tokens
    came is resumed (`resume_streams`) and counts as one."""
    initial_backoff_s: float = 0.1
    """Wait before the first retry; doubles each time, with ±20 % jitter."""
    max_backoff_s: float = 2.0
    """Cap of the wait between retries."""
    reconnect_wait_s: float = 0.0
    """After a failed try (UNAVAILABLE, before any output) whose router does not accept
    connections — restarting, say — wait up to this long for it to do so again before the next
    try; past that the call fails. 0: only the backoff (a router that is down fails calls at once)."""
    resume_streams: bool = True
    """A Generate stream that breaks with UNAVAILABLE after tokens came (its router restarting)
    goes on from those tokens, as one stream (client/resume.py). False: such a call fails."""
    tls: TLSConfig | None = None
    """None: plaintext (loopback / trusted networks)."""
    metadata: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    """Sent with every call (e.g. ("authorization", "Bearer ...") behind an authenticating proxy)."""
    max_message_bytes: int = 16 << 20
    """Largest gRPC message sent or received (grpc's own receive default is 4 MiB)."""

    def __post_init__(self) -> None:
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {self.timeout_s!r}")
        if not self.control_timeout_s > 0:
            raise ValueError(f"control_timeout_s must be > 0, got {self.control_timeout_s!r}")
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"max_attempts must be an integer >= 1, got {self.max_attempts!r}")
        if isinstance(self.max_message_bytes, bool) or not isinstance(self.max_message_bytes, int) \
                or self.max_message_bytes < 1024:  # fmt: skip
            raise ValueError(f"max_message_bytes must be an integer >= 1024, got {self.max_message_bytes!r}")
        if isinstance(self.reconnect_wait_s, bool) or not isinstance(self.reconnect_wait_s, (int, float)) \
                or not 0 <= self.reconnect_wait_s < float("inf"):  # fmt: skip
            raise ValueError(f"reconnect_wait_s must be a number >= 0, got {self.reconnect_wait_s!r}")
        if not 0 <= self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"need 0 <= initial_backoff_s <= max_backoff_s, got {self.initial_backoff_s!r} and {self.max_backoff_s!r}"
            )

    def backoff_s(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based)."""
        base = min(self.max_backoff_s, self.initial_backoff_s * 2 ** (attempt - 1))
        return base * random.uniform(0.8, 1.2)

    def channel_options(self) -> list[tuple[str, object]]:
        options: list[tuple[str, object]] = [
            ("grpc.enable_retries", 0),  # the SDK retries itself, visibly
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
        ]
        if self.tls is not None and self.tls.server_name_override:
            options.append(("grpc.ssl_target_name_override", self.tls.server_name_override))
        return options


def sync_channel(address: str, options: ClientOptions) -> grpc.Channel:
    if options.tls is None:
        return grpc.insecure_channel(address, options.channel_options())
    return grpc.secure_channel(address, options.tls.credentials(), options.channel_options())


def async_channel(address: str, options: ClientOptions) -> grpc.aio.Channel:
    if options.tls is None:
        return grpc.aio.insecure_channel(address, options.channel_options())
    return grpc.aio.secure_channel(address, options.tls.credentials(), options.channel_options())
