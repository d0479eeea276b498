"""Prompt normalization and tokenizer loading for the SDK (text needs a tokenizer; token ids do not)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from splitserve.client.errors import InvalidRequestError
from splitserve.engine.tokenizer import Tokenizer

Prompt = str | Sequence[int]
"""A text prompt, or one prompt's token ids."""

DEFAULT = "default"
"""`tokenizer=DEFAULT` loads the embedded default model's tokenizer (what `splitserve up` serves by default)."""


def load_tokenizer(tokenizer: str | Path | Tokenizer | None) -> Tokenizer | None:
    """A Tokenizer from a model directory, DEFAULT, an instance, or None."""
    if tokenizer is None or isinstance(tokenizer, Tokenizer):
        return tokenizer
    if str(tokenizer) == DEFAULT:
        from splitserve.engine.default_model import default_model_path

        return Tokenizer(default_model_path())
    return Tokenizer(tokenizer)


def is_single_prompt(prompts: object) -> bool:
    """A str or a flat list of ints is one prompt; a list of those is many."""
    if isinstance(prompts, str):
        return True
    return isinstance(prompts, Sequence) and len(prompts) > 0 and all(_is_token(t) for t in prompts)


def as_prompt_list(prompts: object) -> list[Prompt]:
    """LLM.generate's accepted forms as a list of prompts; InvalidRequestError for anything else."""
    if is_single_prompt(prompts):
        return [prompts]  # type: ignore[list-item]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(p, str) or _is_token_list(p) for p in prompts):
        return list(prompts)
    raise InvalidRequestError(
        "prompts must be a string, a list of token ids, or a non-empty list of those; "
        f"got {_describe(prompts)}"
    )


def encode(prompt: Prompt, tokenizer: Tokenizer | None, add_bos: bool) -> list[int]:
    """The prompt's token ids; InvalidRequestError for text without a tokenizer or an empty prompt."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError(
                "a text prompt needs a tokenizer: pass tokenizer=MODEL_DIR (or tokenizer='default' for the "
                "embedded model) to the client, or send token ids"
            )
        ids = tokenizer.encode(prompt, add_bos=add_bos)
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise InvalidRequestError("the prompt is empty (no tokens)")
    if any(t < 0 or t >= 2**31 for t in ids):
        raise InvalidRequestError(f"token ids must be in [0, 2**31), got {min(ids) if min(ids) < 0 else max(ids)}")
    return ids


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_list(value: object) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str) and len(value) > 0 and all(_is_token(t) for t in value)


def _describe(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
