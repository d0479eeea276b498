"""Kernel tests run on CUDA when there is a device, else through the Triton interpreter.

The interpreter is chosen when a `@triton.jit` function is defined, so the kernel
modules are (re)imported here with TRITON_INTERPRET=1; the variable is then put
back and set again only around each kernel test, so the rest of the suite (where
`kernels.triton_available()` reads it) never sees it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import pytest
import torch

KERNEL_MODULES = (  # helpers first: kernels call their @triton.jit functions
    "splitserve.kernels._common",
    "splitserve.kernels._pdl",
    "splitserve.kernels.paged_decode",
    "splitserve.kernels.paged_prefill",
    "splitserve.kernels.kv_write",
    "splitserve.kernels.pack",
    "splitserve.kernels.norm",
    "splitserve.kernels.rotary",
    "splitserve.kernels.activation",
    "splitserve.kernels.linear",
    "splitserve.kernels.qkv_rotary",
    "splitserve.kernels.argmax",
    "splitserve.kernels.logit_adjust",
    "splitserve.kernels.logprobs",
    "splitserve.kernels.kv_checksum",
    "splitserve.kernels.sampling",
    "splitserve.kernels.ssm_state_update",
    "splitserve.kernels.conv1d",
    "splitserve.kernels.ssd_scan",
)
HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = not torch.cuda.is_available()


def _fix_old_interpreter_index() -> None:
    """Triton < 3.7's interpreter turns loop bounds into ints with int(array of shape (1,)),
    which numpy >= 2.4 refuses; newer Triton squeezes first. Do the same on old versions."""
    import triton
    from triton.runtime import interpreter

    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    if (major, minor) >= (3, 7):
        return
    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch


def _import_kernels_interpreted() -> None:
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        _fix_old_interpreter_index()
        for name in KERNEL_MODULES:
            if name in sys.modules:
                importlib.reload(sys.modules[name])
            else:
                importlib.import_module(name)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


if HAS_TRITON and INTERPRET:
    _import_kernels_interpreted()


def _kernels_are_interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    for name in KERNEL_MODULES:
        module = sys.modules.get(name)
        if module is None:
            return False
        jitted = [v for v in vars(module).values() if type(v).__name__ in ("JITFunction", "InterpretedFunction")]
        if not all(isinstance(v, InterpretedFunction) for v in jitted):
            return False
    return True


@pytest.fixture(autouse=True)
def _interpreter_env(monkeypatch):
    if HAS_TRITON and INTERPRET:
        # Another test may have re-imported a kernel module without the interpreter
        # (a @triton.jit defined then is a GPU function): import them again if so.
        if not _kernels_are_interpreted():
            _import_kernels_interpreted()
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cpu" if INTERPRET else "cuda")
