"""The immutable inputs and output of a routing decision (policy.py works on these only).

A `Snapshot` is what the router knew when a request arrived: for every
routable worker, how much of the request's prompt it caches and how loaded
it is. Policies are pure functions of it, so they are tested on hand-built
snapshots without a network.
"""

from __future__ import annotations

from dataclasses import dataclass


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class WorkerState:
    """One worker as seen for one request."""

    worker_id: str
    num_prefix_blocks: int = 0
    """Leading blocks of the request's prompt the worker caches."""
    num_running: int = 0
    """Requests in flight on it: the router's own count, or the worker's report when larger."""
    max_running: int = 256
    """Requests it may run at once (router config); at this count it is full."""
    kv_usage: float | None = None
    """Fraction of its KV blocks in use, as last reported; None = no report."""
    tiebreak: int = 0
    """Breaks ties between equally loaded workers before the worker id: a hash of the
    request's first block and the worker, so new prefixes spread over idle workers
    (always the lowest id would pile them on one) while a repeated prefix still
    picks the same worker. 0 everywhere = ties by id."""

    def __post_init__(self) -> None:
        if not isinstance(self.worker_id, str) or not self.worker_id:
            raise ValueError(f"worker_id must be a non-empty string, got {self.worker_id!r}")
        _check_int("num_prefix_blocks", self.num_prefix_blocks, 0)
        _check_int("num_running", self.num_running, 0)
        _check_int("max_running", self.max_running, 1)
        if self.kv_usage is not None and not (isinstance(self.kv_usage, int | float) and 0 <= self.kv_usage <= 1):
            raise ValueError(f"kv_usage must be in [0, 1] or None, got {self.kv_usage!r}")

    @property
    def load(self) -> float:
        """In [0, 1]: the larger of the request-slot and KV-block occupancy."""
        return min(1.0, max(self.num_running / self.max_running, self.kv_usage or 0.0))

    @property
    def is_full(self) -> bool:
        return self.num_running >= self.max_running


@dataclass(frozen=True)
class Snapshot:
    """Everything a policy may look at for one request."""

    prompt_len: int
    """Prompt tokens."""
    block_size: int
    """Tokens per KV block (the same on every worker: checked when the router starts)."""
    prefill: tuple[WorkerState, ...] = ()
    """Routable prefill workers."""
    decode: tuple[WorkerState, ...] = ()
    """Routable decode workers."""

    def __post_init__(self) -> None:
        _check_int("prompt_len", self.prompt_len, 1)
        _check_int("block_size", self.block_size, 1)
        ids = [w.worker_id for w in (*self.prefill, *self.decode)]
        if len(ids) != len(set(ids)):
            raise ValueError(f"worker ids must be unique across both pools, got {ids!r}")
        for worker in (*self.prefill, *self.decode):
            if worker.num_prefix_blocks > self.num_blocks:
                raise ValueError(
                    f"worker {worker.worker_id!r} caches {worker.num_prefix_blocks!r} blocks "
                    f"of a prompt with {self.num_blocks} full blocks"
                )

    @property
    def num_blocks(self) -> int:
        """Full blocks of the prompt (the ones that have hashes)."""
        return self.prompt_len // self.block_size

    @property
    def num_kv_blocks(self) -> int:
        """Blocks the prompt's KV occupies, the partial last one included."""
        return -(-self.prompt_len // self.block_size)


@dataclass(frozen=True)
class RoutingDecision:
    """Where one request runs."""

    prefill_worker_id: str | None
    """None: aggregated, the decode worker prefills the prompt itself."""
    decode_worker_id: str
    num_predicted_cached_tokens: int
    """Prompt tokens the worker that prefills is expected to find in its cache."""
    reason: str
    """Why, for logs and the routing summary."""
    num_transfer_blocks: int = 0
    """KV blocks the handoff moves: the prompt's blocks the decode worker does not hold (0 if aggregated)."""
    num_transfer_bytes: int | None = None
    """`num_transfer_blocks` x bytes per block, when the router knows the block size in bytes."""

    def __post_init__(self) -> None:
        if not self.decode_worker_id:
            raise ValueError(f"decode_worker_id must be set, got {self.decode_worker_id!r}")
        _check_int("num_predicted_cached_tokens", self.num_predicted_cached_tokens, 0)
        _check_int("num_transfer_blocks", self.num_transfer_blocks, 0)
        if self.prefill_worker_id is None and self.num_transfer_blocks:
            raise ValueError(f"an aggregated decision moves no blocks, got {self.num_transfer_blocks!r}")

    @property
    def is_disaggregated(self) -> bool:
        return self.prefill_worker_id is not None
