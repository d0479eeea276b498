"""Shared fixtures: tiny Hugging Face checkpoints built from random configs on the spot."""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
import types
from pathlib import Path

import pytest


def _hide_repo_root() -> None:
    """Take the checkout's root off `sys.path`, keeping only `tests` importable from it.

    `python -m pytest` (and any `python -c` run from the checkout) puts the root on `sys.path`,
    and the root holds the project's folders under generic names (`kernels`, `router`, `engine`,
    ...) that are installed as `splitserve.*`. As top-level names they shadow libraries of the same
    name: transformers >= 5.25 imports any importable `kernels` as Hugging Face's `kernels`
    library and failed every model build on ours. The tests import their helpers as `tests.*`,
    so `tests` is registered as the namespace package it is, and nothing else from the root
    stays visible.
    """
    root = Path(__file__).resolve().parent.parent
    sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != root]
    if "tests" not in sys.modules:
        pkg = types.ModuleType("tests")
        pkg.__path__ = [str(root / "tests")]
        sys.modules["tests"] = pkg


_hide_repo_root()

from tests.fixtures.models import build_hf_checkpoint, build_tokenizer  # noqa: E402

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
# The suite is written for the CPU (the CI machine has no GPU): an engine built with the "auto" device
# (and every worker process a test starts) runs there on a GPU host too, where it would otherwise pick
# CUDA and meet the CPU tests' assumptions (shm/gloo transports, fp32 numerics). Tests of the GPU path
# ask for device="cuda" themselves and skip without one.
os.environ.setdefault("SPLITSERVE_AUTO_DEVICE", "cpu")

ASYNC_TEST_TIMEOUT_S = 120


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run `async def test_*` under asyncio.run with a time cap (no pytest-asyncio needed)."""
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    asyncio.run(asyncio.wait_for(pyfuncitem.obj(**kwargs), ASYNC_TEST_TIMEOUT_S))
    return True

@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    build_hf_checkpoint(path, "llama")
    return path


@pytest.fixture(scope="session")
def text_ckpt(tmp_path_factory):
    """A random Llama with a real tokenizer (eos = </s> = id 2)."""
    path = tmp_path_factory.mktemp("text")
    build_hf_checkpoint(path, "llama", eos_token_id=2, bos_token_id=1)
    build_tokenizer(path)
    return path
