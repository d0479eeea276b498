"""`splitserve.kernels` imports nothing heavy until a kernel is used."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest


def _loaded_after(statement: str) -> list[str]:
    code = f"import sys; {statement}; print('triton' in sys.modules, 'torch' in sys.modules)"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()


def test_import_loads_neither_triton_nor_torch():
    assert _loaded_after("import splitserve.kernels") == ["False", "False"]


def test_decode_plan_needs_no_triton():
    """The engine sizes decode workspaces (before CUDA-graph capture) without triton."""
    assert _loaded_after("import splitserve.kernels.decode_plan") == ["False", "True"]


def test_triton_available_follows_interpreter_and_cuda(monkeypatch):
    import torch

    from splitserve import kernels

    has_triton = importlib.util.find_spec("triton") is not None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.triton_available() is has_triton
    monkeypatch.delenv("TRITON_INTERPRET")
    assert kernels.triton_available() is (has_triton and torch.cuda.is_available())


def test_lazy_attributes():
    pytest.importorskip("triton")
    from splitserve import kernels

    assert callable(kernels.paged_decode_attention) and callable(kernels.write_kv)
    with pytest.raises(AttributeError):
        kernels.no_such_kernel  # noqa: B018
