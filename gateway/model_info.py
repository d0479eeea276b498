"""The served model as the gateway sees it: name, tokenizer, context length, vocabulary."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from splitserve.engine.tokenizer import Tokenizer

DEFAULT_MODEL_NAME = "splitserve-default"
"""What `GET /v1/models` calls the embedded default model (engine/default_model)."""


@dataclass(frozen=True)
class ModelInfo:
    name: str
    """The id clients put in `model`."""
    path: Path
    tokenizer: Tokenizer
    max_model_len: int
    """Prompt + generated tokens one request may use."""
    vocab_size: int
    """Token ids must lie in [0, vocab_size)."""
    created: int
    """Unix time the gateway loaded it (the `created` of /v1/models)."""


def load_model_info(path: str | Path | None, name: str | None = None, max_model_len: int | None = None) -> ModelInfo:
    """Reads config.json and the tokenizer of `path` (None: the embedded default model).

    The name is `name`, else the directory's name (DEFAULT_MODEL_NAME for the
    embedded model); the context is `max_model_len`, else the model's
    max_position_embeddings (or the tokenizer's model_max_length).
    """
    if path is None:
        from splitserve.engine.default_model import default_model_path

        path, name = default_model_path(), name or DEFAULT_MODEL_NAME
    path = Path(path).resolve()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {str(path)!r}: not a Hugging Face model directory")
    config = json.loads((path / "config.json").read_text())
    text_config = config.get("text_config", config)
    tokenizer = Tokenizer(path)
    context = max_model_len or text_config.get("max_position_embeddings") or _tokenizer_max_len(path)
    if not context or context < 2:
        raise ValueError(f"cannot tell the context length of {str(path)!r}; pass --max-model-len")
    vocab = max(int(text_config.get("vocab_size") or 0), tokenizer.vocab_size)
    return ModelInfo(
        name=name or path.name, path=path, tokenizer=tokenizer, max_model_len=int(context), vocab_size=vocab,
        created=int(time.time()),
    )  # fmt: skip


def _tokenizer_max_len(path: Path) -> int | None:
    file = path / "tokenizer_config.json"
    if not file.is_file():
        return None
    value = json.loads(file.read_text()).get("model_max_length")
    return int(value) if isinstance(value, int | float) and value < 1e9 else None
