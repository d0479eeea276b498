"""`RouterConfig`: the settings of one router process (flags: see cli.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.router.policy import PolicyConfig


def _check_address(name: str, value: object) -> None:
    host, sep, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{name} must be host:port, got {value!r}")


def _check_positive(name: str, value: object, kind: type = int) -> None:
    if not isinstance(value, kind | int) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"{name} must be a positive {kind.__name__}, got {value!r}")


@dataclass(frozen=True)
class RouterConfig:
    """Composed of the policy's settings and the serving ones."""

    control_planes: tuple[str, ...] = ()
    """Control-plane replica addresses (host:port) to follow WatchTopology on, tried in order."""
    listen: str = "127.0.0.1:0"
    """gRPC listen address of the Router service; port 0 picks a free one."""
    block_size: int | None = None
    """Tokens per KV block; None = the one the workers advertise. A worker advertising another
    is an error at start."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    kv_events: bool = True
    """Follow the workers' KV events; False = approximate mode (index what was routed, with a TTL)."""
    approximate_ttl_s: float = 120.0
    """Approximate mode, and workers that publish no events: how long a routed prompt counts as cached."""
    max_in_flight: int = 1024
    """Requests this router runs at once; more are refused with RESOURCE_EXHAUSTED."""
    ttft_slo_s: float = 0.0
    """Admission: refuse (RESOURCE_EXHAUSTED) a request whose predicted time to first token
    exceeds this many seconds; 0 = off. The prediction is the prompt tokens waiting for their
    first token, this one included, over `prefill_tokens_per_s` times the prefill workers."""
    prefill_tokens_per_s: float = 20000.0
    """Admission model: prompt tokens one prefill worker computes per second."""
    max_running_per_worker: int = 256
    """Requests one worker may have from this router; a worker at the limit is not picked."""
    max_prefill_attempts: int = 3
    """Prefill calls per request, the first included, before serving aggregated (or failing)."""
    max_decode_attempts: int = 3
    """Decode calls per request, the first included, while no token of the decode stream was sent."""
    prefill_timeout_s: float = 60.0
    """Deadline of one Prefill call."""
    decode_timeout_s: float = 600.0
    """Deadline of one whole Decode stream."""
    decode_first_chunk_timeout_s: float = 60.0
    """A Decode stream with no first chunk by then is cancelled and retried on another decode
    worker (a hung worker: SIGSTOPped, deadlocked, or a lost connection nobody reset)."""
    decode_stall_timeout_s: float = 60.0
    """A Decode stream with no chunk for this long after its first one is cancelled and fails
    UNAVAILABLE (tokens were sent, so it cannot be retried transparently)."""
    suspect_cooldown_s: float = 10.0
    """A worker whose call failed with UNAVAILABLE or DEADLINE_EXCEEDED is not routed to for
    this long (unless every worker of its role is suspect); 0 = never skip. About one etcd
    lease TTL: by then a dead worker has left the topology."""
    control_timeout_s: float = 5.0
    """Deadline of Abort and GetBlockSet calls."""
    topology_timeout_s: float = 30.0
    """How long start() waits for the first topology."""
    grace_period_s: float = 5.0
    """On shutdown, how long running requests may go on."""
    metrics_port: int = 0
    """HTTP port of Prometheus /metrics; 0 = not served."""
    metrics_host: str = "127.0.0.1"
    """Bind address of /metrics."""

    def __post_init__(self) -> None:
        if isinstance(self.control_planes, str):
            object.__setattr__(self, "control_planes", (self.control_planes,))
        for address in self.control_planes:
            _check_address("control plane address", address)
        _check_address("listen", self.listen)
        if self.block_size is not None:
            _check_positive("block_size", self.block_size)
        if not isinstance(self.policy, PolicyConfig):
            raise ValueError(f"policy must be a PolicyConfig, got {self.policy!r}")
        for name in ("max_in_flight", "max_running_per_worker", "max_prefill_attempts", "max_decode_attempts"):
            _check_positive(name, getattr(self, name))
        if not isinstance(self.ttft_slo_s, int | float) or isinstance(self.ttft_slo_s, bool) or self.ttft_slo_s < 0:
            raise ValueError(f"ttft_slo_s must be a number >= 0, got {self.ttft_slo_s!r}")
        _check_positive("prefill_tokens_per_s", self.prefill_tokens_per_s, float)
        for name in ("approximate_ttl_s", "prefill_timeout_s", "decode_timeout_s", "control_timeout_s", "topology_timeout_s",
                     "decode_first_chunk_timeout_s", "decode_stall_timeout_s"):
            _check_positive(name, getattr(self, name), float)
        if isinstance(self.metrics_port, bool) or not isinstance(self.metrics_port, int) or not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65536), got {self.metrics_port!r}")
        if not isinstance(self.suspect_cooldown_s, int | float) or isinstance(self.suspect_cooldown_s, bool) \
                or self.suspect_cooldown_s < 0:
            raise ValueError(f"suspect_cooldown_s must be a number >= 0, got {self.suspect_cooldown_s!r}")
        if not isinstance(self.grace_period_s, int | float) or self.grace_period_s < 0:
            raise ValueError(f"grace_period_s must be >= 0, got {self.grace_period_s!r}")
