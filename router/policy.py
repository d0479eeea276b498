"""Routing policies: pure functions from a `Snapshot` to a worker or a `RoutingDecision`.

Prefill worker choice (names from the reference design's
`prefix_caching_coordinator_policy`, plus `scored` for its routing alpha):

    load_balanced       least loaded
    longest_prefix      longest cached prefix of the prompt; ties -> least loaded
    first_prefix_block  least loaded among the workers caching the prompt's first block
                        (all workers when none does): sticky per conversation, spreads the rest
    scored              max  alpha * cached_fraction + (1 - alpha) * (1 - load)
                        alpha = 0: pure load balance, alpha = 1: pure cache affinity

Every tie ends in the lower worker id, so decisions are deterministic.
Decode worker choice weighs load against the bytes the handoff moves:

    cost = (1 - transfer_weight) * load + transfer_weight * blocks_to_move / prompt_kv_blocks

where blocks_to_move are the prompt's KV blocks the decode worker does not
already cache. `route` then decides whether to disaggregate at all
(conditional disaggregation, see `PolicyConfig.disagg_min_uncached_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from splitserve.router.snapshot import RoutingDecision, Snapshot, WorkerState

POLICIES = ("load_balanced", "longest_prefix", "first_prefix_block", "scored")


class RoutingError(RuntimeError):
    """No decision is possible for this request."""


class NoWorkersError(RoutingError):
    """No decode worker is routable (none registered, or all draining)."""


class DisaggRequiredError(RoutingError):
    """enforce_disagg is set but no prefill worker is routable."""


class OverloadedError(RoutingError):
    """Every candidate worker is full; the request should be retried later."""


@dataclass(frozen=True)
class PolicyConfig:
    """How the router picks workers (flags: see cli.py)."""

    policy: str = "scored"
    """Prefill-worker policy, one of POLICIES."""
    routing_alpha: float = 0.01
    """`scored` only: weight of cache affinity against load, in [0, 1]. Load is in-flight
    requests / max_running (256), so one request moves it by 0.004: 0.01 makes a full
    prefix match worth about 2.5 requests of load. Chosen with `splitserve bench router`
    on the Mooncake trace (100% of the oracle's cached fraction at max/mean load 1.30;
    0.5 gave 1.34, 0.005 gave 1.25 at 94% of the oracle)."""
    transfer_weight: float = 0.5
    """Decode choice: weight of the handoff's size against the decode worker's load, in [0, 1]."""
    disagg_min_uncached_tokens: int = 0
    """Disaggregate only when at least this many prompt tokens are not cached on the chosen decode
    worker; shorter remainders are prefilled by the decode worker itself. 0 = always disaggregate."""
    enforce_disagg: bool = False
    """Fail (DisaggRequiredError) rather than serve aggregated when no prefill worker is routable."""
    kv_bytes_per_block: int | None = None
    """Bytes of one KV block over all layers and ranks, to report handoff bytes; None = unknown."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("routing_alpha", "transfer_weight"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        value = self.disagg_min_uncached_tokens
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"disagg_min_uncached_tokens must be an integer >= 0, got {value!r}")
        if self.kv_bytes_per_block is not None and (
            not isinstance(self.kv_bytes_per_block, int) or self.kv_bytes_per_block < 1
        ):
            raise ValueError(f"kv_bytes_per_block must be a positive integer or None, got {self.kv_bytes_per_block!r}")


def _least_loaded_key(worker: WorkerState) -> tuple:
    return (worker.load, worker.num_running, worker.tiebreak, worker.worker_id)


def load_balanced(workers: Sequence[WorkerState]) -> WorkerState | None:
    """The least loaded worker (ties: fewer running requests, then lower id); None if empty."""
    return min(workers, key=_least_loaded_key, default=None)


def longest_prefix(workers: Sequence[WorkerState]) -> WorkerState | None:
    """The worker caching the longest prefix (ties: least loaded, then lower id)."""
    return min(workers, key=lambda w: (-w.num_prefix_blocks, *_least_loaded_key(w)), default=None)


def first_prefix_block(workers: Sequence[WorkerState]) -> WorkerState | None:
    """The least loaded worker among those caching the first block; all workers if none does."""
    holding = [w for w in workers if w.num_prefix_blocks > 0]
    return load_balanced(holding or workers)


def scored(workers: Sequence[WorkerState], num_blocks: int, alpha: float) -> WorkerState | None:
    """Max of alpha * cached fraction + (1 - alpha) * free capacity (ties: longer prefix, least loaded, id)."""

    def key(worker: WorkerState) -> tuple:
        match = worker.num_prefix_blocks / num_blocks if num_blocks else 0.0
        score = alpha * match + (1.0 - alpha) * (1.0 - worker.load)
        return (-score, -worker.num_prefix_blocks, *_least_loaded_key(worker))

    return min(workers, key=key, default=None)


def choose_prefill(snapshot: Snapshot, config: PolicyConfig) -> WorkerState | None:
    """The prefill worker `config.policy` picks among those not full; None if there are none."""
    candidates = [w for w in snapshot.prefill if not w.is_full]
    pickers: dict[str, Callable[[Sequence[WorkerState]], WorkerState | None]] = {
        "load_balanced": load_balanced,
        "longest_prefix": longest_prefix,
        "first_prefix_block": first_prefix_block,
        "scored": lambda ws: scored(ws, snapshot.num_blocks, config.routing_alpha),
    }
    return pickers[config.policy](candidates)


def transfer_blocks(snapshot: Snapshot, decode: WorkerState) -> int:
    """KV blocks a handoff to `decode` moves: the prompt's blocks it does not already cache."""
    return snapshot.num_kv_blocks - decode.num_prefix_blocks


def choose_decode(snapshot: Snapshot, transfer_weight: float) -> WorkerState | None:
    """The decode worker (not full) with the lowest load/transfer cost (ties: longer prefix, least loaded, id)."""

    def key(worker: WorkerState) -> tuple:
        moved = transfer_blocks(snapshot, worker) / snapshot.num_kv_blocks
        cost = (1.0 - transfer_weight) * worker.load + transfer_weight * moved
        return (cost, -worker.num_prefix_blocks, *_least_loaded_key(worker))

    return min((w for w in snapshot.decode if not w.is_full), key=key, default=None)


def route(snapshot: Snapshot, config: PolicyConfig, enforce_disagg: bool | None = None) -> RoutingDecision:
    """Picks the decode worker, then whether and where to prefill.

    `enforce_disagg` overrides `config.enforce_disagg` for this request when
    not None. Raises NoWorkersError, DisaggRequiredError or OverloadedError.
    """
    enforce = config.enforce_disagg if enforce_disagg is None else enforce_disagg
    if not snapshot.decode:
        raise NoWorkersError("no routable decode worker")
    decode = choose_decode(snapshot, config.transfer_weight)
    if decode is None:
        raise OverloadedError(f"all {len(snapshot.decode)} decode workers are full")
    decode_cached = decode.num_prefix_blocks * snapshot.block_size
    on_decode = f"decode {decode.worker_id} (load {decode.load:.2f}, caches {decode.num_prefix_blocks}/{snapshot.num_blocks} blocks)"
    if not snapshot.prefill:
        if enforce:
            raise DisaggRequiredError("enforce_disagg is set but no prefill worker is routable")
        return RoutingDecision(None, decode.worker_id, decode_cached, f"aggregated: no prefill worker; {on_decode}")
    uncached = snapshot.prompt_len - decode_cached
    if not enforce and uncached < config.disagg_min_uncached_tokens:
        reason = f"aggregated: {uncached} uncached tokens < disagg_min_uncached_tokens={config.disagg_min_uncached_tokens}; {on_decode}"
        return RoutingDecision(None, decode.worker_id, decode_cached, reason)
    prefill = choose_prefill(snapshot, config)
    if prefill is None:
        raise OverloadedError(f"all {len(snapshot.prefill)} prefill workers are full")
    num_moved = transfer_blocks(snapshot, decode)
    policy = f"scored(alpha={config.routing_alpha:g})" if config.policy == "scored" else config.policy
    reason = (
        f"disaggregated: {policy} picked prefill {prefill.worker_id} (load {prefill.load:.2f}, caches "
        f"{prefill.num_prefix_blocks}/{snapshot.num_blocks} blocks); {on_decode}, moves {num_moved} blocks"
    )
    num_bytes = None if config.kv_bytes_per_block is None else num_moved * config.kv_bytes_per_block
    return RoutingDecision(
        prefill.worker_id, decode.worker_id, prefill.num_prefix_blocks * snapshot.block_size, reason, num_moved, num_bytes
    )
