"""A worker's KV-pool integrity check, for the CheckIntegrity debug RPC of both worker services.

The check runs as an engine-loop command ("integrity"), so it sees the pool between
steps, never mid-step. Every rank checks its own engine (a broken rank raises there and
the error is logged); rank 0's counts are the ones reported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from splitserve.engine.engine import Engine
from splitserve.proto.v1 import common_pb2


@dataclass(frozen=True)
class IntegrityReport:
    is_ok: bool
    problem: str
    """Why the check failed; empty when it passed."""
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_in_use_blocks: int
    num_pinned_blocks: int
    num_requests: int
    """Waiting or running in the engine."""
    num_handoffs: int
    """Pinned handoffs waiting for their ack or lease expiry."""


def check_integrity(engine: Engine) -> IntegrityReport:
    """`Engine.check_integrity()` plus the pool's counts (engine thread only)."""
    try:
        engine.check_integrity()
        problem = ""
    except AssertionError as exc:
        problem = str(exc) or "integrity check failed"
    stats = engine.pool.stats()
    return IntegrityReport(
        is_ok=not problem, problem=problem, num_blocks=stats.num_blocks, num_free_blocks=stats.num_free,
        num_cached_blocks=stats.num_cached, num_in_use_blocks=stats.num_in_use, num_pinned_blocks=stats.num_pinned,
        num_requests=engine.scheduler.num_unfinished, num_handoffs=len(engine.handoffs),
    )  # fmt: skip


def integrity_to_proto(report: IntegrityReport, *, num_in_flight: int, is_draining: bool) -> common_pb2.IntegrityReport:
    r = report
    return common_pb2.IntegrityReport(
        is_ok=r.is_ok, problem=r.problem, num_blocks=r.num_blocks, num_free_blocks=r.num_free_blocks,
        num_cached_blocks=r.num_cached_blocks, num_in_use_blocks=r.num_in_use_blocks,
        num_pinned_blocks=r.num_pinned_blocks, num_requests=r.num_requests, num_handoffs=r.num_handoffs,
        num_in_flight=num_in_flight, is_draining=is_draining, pid=os.getpid(),
    )  # fmt: skip
