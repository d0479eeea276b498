"""The checks of a request's logit adjustments — OpenAI's `logit_bias`, `presence_penalty` and
`frequency_penalty` — shared by the engine's SamplingParams, the SDK's and the gateway (no torch:
light processes import it). The adjustment itself: engine/adjusted_rows.py."""

from __future__ import annotations

BIAS_RANGE = (-100.0, 100.0)
PENALTY_RANGE = (-2.0, 2.0)


def bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """A logit bias (a {token id: bias} dict or (id, bias) pairs) as sorted pairs; ValueError
    quoting what is wrong."""
    pairs = value.items() if isinstance(value, dict) else value
    try:
        pairs = [tuple(pair) for pair in pairs]
    except TypeError:
        raise ValueError(f"logit_bias must map token ids to numbers, got {value!r}") from None
    out = {}
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"logit_bias entries must be (token id, bias) pairs, got {pair!r}")
        token, bias = pair
        if not _is_int(token) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        low, high = BIAS_RANGE
        if not _is_number(bias) or not low <= bias <= high:
            raise ValueError(f"logit_bias values must be numbers in [{low:g}, {high:g}], got {bias!r} for token {token}")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def check_penalty(name: str, value: object) -> None:
    low, high = PENALTY_RANGE
    if not _is_number(value) or not low <= value <= high:
        raise ValueError(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
