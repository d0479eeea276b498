"""The gateway's configuration: one frozen dataclass, each field documented and validated."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from splitserve.client.options import TLSConfig

DEFAULT_MAX_BODY_BYTES = 8 << 20


@dataclass(frozen=True)
class GatewayConfig:
    router: str = "127.0.0.1:50061"
    """Router gRPC address (HOST:PORT)."""
    model: Path | None = None
    """Model directory the workers serve (its tokenizer and config.json); None = the embedded default model."""
    served_model_name: str | None = None
    """Name in /v1/models and the `model` field; None = the directory's name."""
    host: str = "127.0.0.1"
    """HTTP bind address; loopback unless told otherwise."""
    port: int = 8000
    """HTTP port; 0 picks a free one."""
    api_keys: tuple[str, ...] = ()
    """Accepted `Authorization: Bearer` keys; empty = no authentication."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Larger request bodies get 413."""
    max_model_len: int | None = None
    """Prompt + completion tokens per request; None = the model's max_position_embeddings."""
    reasoning_parser: str = "none"
    """"think" splits <think>…</think> into reasoning_content; "none" leaves the text alone."""
    tool_call_parser: str = "hermes"
    """"hermes" parses <tool_call>{json}</tool_call> when a request has tools; "none" never parses."""
    request_timeout_s: float | None = 600.0
    """Deadline of one choice's Generate call; None = none."""
    max_in_flight: int = 1024
    """Generation requests handled at once; more get 429 + Retry-After at once (bounded memory)."""
    router_tls: TLSConfig | None = None
    """TLS (mutual with a client certificate) to the router; None = plaintext."""
    max_grpc_message_bytes: int = 16 << 20
    """Largest gRPC message to or from the router."""

    def __post_init__(self) -> None:
        if not self.router or ":" not in self.router:
            raise ValueError(f"router must be HOST:PORT, got {self.router!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port!r}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len!r}")
        if self.reasoning_parser not in ("none", "think"):
            raise ValueError(f"reasoning_parser must be 'none' or 'think', got {self.reasoning_parser!r}")
        if self.tool_call_parser not in ("none", "hermes"):
            raise ValueError(f"tool_call_parser must be 'none' or 'hermes', got {self.tool_call_parser!r}")
        if any(not key for key in self.api_keys):
            raise ValueError("api_keys may not contain an empty key")
        if isinstance(self.max_in_flight, bool) or not isinstance(self.max_in_flight, int) or self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an integer >= 1, got {self.max_in_flight!r}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s!r}")
