"""Admission against a TTFT SLO (pure): predict a request's time to first token
from the prompt tokens already waiting for theirs and a prefill-speed model, and
refuse early — RESOURCE_EXHAUSTED at the router, HTTP 429 + Retry-After at the
gateway — rather than accept work that cannot meet the SLO."""

from __future__ import annotations

from collections.abc import Iterable

from splitserve.control_plane.shard_spec import Role
from splitserve.router.policy import OverloadedError


def predicted_ttft_s(waiting_tokens: int, prompt_tokens: int, prefill_tokens_per_s: float, num_prefill: int) -> float:
    """Seconds until this prompt's first token if prefill workers drain the queue at their speed."""
    return (waiting_tokens + prompt_tokens) / (prefill_tokens_per_s * max(1, num_prefill))


def check_ttft_slo(
    slo_s: float, roles: Iterable[Role], waiting_tokens: int, prompt_tokens: int, prefill_tokens_per_s: float
) -> None:
    """Raise OverloadedError when the predicted TTFT exceeds `slo_s` (0 = admission off).
    Without prefill workers the decode workers prefill, so they count instead."""
    if not slo_s:
        return
    roles = list(roles)
    num_prefill = sum(1 for r in roles if r is Role.PREFILL) or sum(1 for r in roles if r is Role.DECODE)
    predicted = predicted_ttft_s(waiting_tokens, prompt_tokens, prefill_tokens_per_s, num_prefill)
    if predicted > slo_s:
        raise OverloadedError(
            f"predicted time to first token {predicted:.2f} s exceeds the TTFT SLO of {slo_s:g} s "
            f"({waiting_tokens + prompt_tokens} prompt tokens waiting on {num_prefill} prefill worker(s)); retry later"
        )
