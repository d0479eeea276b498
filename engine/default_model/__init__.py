"""The embedded default model: a tiny Llama trained by this project.

``files/`` (package data) holds a Hugging Face checkpoint — ``config.json``,
``model.safetensors``, ``generation_config.json``, ``tokenizer.json``,
``tokenizer_config.json`` — built offline from the Python standard library by
``python -m splitserve.engine.default_model.train``. It lets
``splitserve generate`` run with no arguments and no network. This module
imports nothing heavy, so torch-free processes may call ``default_model_path``.
"""

from __future__ import annotations

from pathlib import Path

FILES_DIR = Path(__file__).resolve().parent / "files"
"""Where the trainer writes by default and where the package data ships."""

REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

BUILD_COMMAND = "python -m splitserve.engine.default_model.train"

__all__ = ["FILES_DIR", "REQUIRED_FILES", "BUILD_COMMAND", "default_model_path"]


def default_model_path() -> Path:
    """Directory of the default model, loadable with ``from_pretrained``.

    Raises ``FileNotFoundError`` naming the missing files and the command that
    builds them.
    """
    missing = [name for name in REQUIRED_FILES if not (FILES_DIR / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the embedded default model is missing {', '.join(missing)} in {FILES_DIR}; "
            f"build it (about 10 minutes on one CPU core, offline) with: {BUILD_COMMAND}"
        )
    return FILES_DIR
