"""The pull-transport interface every KV transport implements (NIXL, in-process).

    source rank                                  destination rank
    ───────────                                  ────────────────
    meta = t.expose(kv)      ── meta bytes ──▶   (carried in the handoff descriptor, over gRPC)
      (once per worker: registers                stats = t.pull(plan, dst_rank, {src_rank: meta}, kv)
       the whole KV pool)                          (reads its ops' regions from the sources)
    t.close()                                    t.close()

The source does nothing per request: it exposes its pool once and keeps the request's blocks
pinned until the destination acknowledges. `torch_dist` is two-sided (both ranks must call) and
so has its own `send_plan`/`recv_plan` functions instead of `pull`; a worker holds it as a
`TransportEndpoint` (expose / unexpose / close), the part every transport shares.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from splitserve.engine.transfer.plan import TransferPlan
from splitserve.engine.transfer.progress import ProgressBoard


class TransferError(RuntimeError):
    """A transfer failed; the request's KV on the destination must not be used."""


class TransferTimeout(TransferError):
    """A transfer did not complete within its deadline (it was cancelled where possible)."""


@dataclass(slots=True)
class TransferStats:
    """What one `pull` moved. A plain slotted record, not frozen: every pull makes one, and a
    frozen dataclass's construction cost ~0.4 µs more (1-2% of a 1k-token GPU pull)."""

    num_bytes: int
    seconds: float
    num_regions: int
    """Memory regions (descriptors) the transport handed to its backend."""

    def __post_init__(self) -> None:
        if self.num_bytes < 0 or self.seconds < 0 or self.num_regions < 0:
            raise ValueError(f"TransferStats values must be >= 0, got {self!r}")

    @property
    def gbps(self) -> float:
        """Gigabytes (1e9) per second; 0 when nothing moved."""
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 and self.num_bytes else 0.0


class TransportEndpoint(abc.ABC):
    """What a worker rank holds of any transport: publish its KV pool, forget it, close."""

    kind: str = ""
    """The descriptor's `transport_kind` for this transport ("nixl", "torch_dist", ...)."""

    @abc.abstractmethod
    def expose(self, kv_tensors: Sequence[torch.Tensor]) -> bytes:
        """Make this rank's per-layer KV tensors readable by remote peers; return endpoint metadata.

        The tensors must stay allocated (and are read concurrently by peers) until `close()`.
        Call once per worker with the whole pool, not per request.
        """

    def unexpose(self) -> None:  # noqa: B027 - optional hook, a no-op for transports holding no registrations
        """Forget the exposed memory before it is freed (lifecycle suspend); `expose` again after."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release registrations and connections. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVTransport(TransportEndpoint):
    """One worker rank's end of a pull transport. Not thread-safe: one caller at a time."""

    @abc.abstractmethod
    def pull(
        self,
        plan: TransferPlan,
        dst_rank: int,
        remote: Mapping[int, bytes],
        kv_tensors: Sequence[torch.Tensor],
        timeout_s: float = 30.0,
    ) -> TransferStats:
        """Copy every op of `plan` whose destination is `dst_rank` into `kv_tensors`.

        `remote[src_rank]` is the metadata the source rank's `expose` returned (ranks the plan
        does not read from may be absent). Blocks off the plan are never written. Blocks until
        done; raises `TransferTimeout` after `timeout_s`, `TransferError` on failure.
        """

    # Layer-wise streaming (progress.py, streaming.py). A transport that streams creates its
    # rank's progress board in `expose` (one row per slot, sized from the tensors) and puts its
    # location in the metadata; `board` stays None for the others.
    board: ProgressBoard | None = None

    def read_board(self, metadata: bytes, slot: int, width: int) -> list[int]:
        """Row `slot` (`width` int64 values) of the board of the peer whose `expose` returned
        `metadata`, as it is now (a plain read, front to back)."""
        raise TransferError(f"the {self.kind or type(self).__name__} transport has no layer-wise streaming")


def needed_sources(plan: TransferPlan, dst_rank: int, remote: Mapping[int, bytes]) -> tuple[int, ...]:
    """Source ranks `dst_rank` reads from, checking `remote` has metadata for each."""
    sources = plan.sources_for(dst_rank)
    for rank in sources:
        if rank not in remote:
            missing = [r for r in sources if r not in remote]
            raise ValueError(f"no endpoint metadata for source ranks {missing} (have {sorted(remote)})")
    return sources
