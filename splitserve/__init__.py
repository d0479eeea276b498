"""splitserve: disaggregated prefill/decode LLM serving.

The public Python API is re-exported lazily so that torch-free processes
(router, control plane, gateway, SDK) can import `splitserve.<pkg>` without
paying for — or requiring — torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncLLM", "SamplingParams", "GenerationResult"]

_LAZY = {
    "LLM": "splitserve.engine.llm",
    "AsyncLLM": "splitserve.engine.llm",
    "SamplingParams": "splitserve.engine.sampling_params",
    "GenerationResult": "splitserve.engine.request",
}

if TYPE_CHECKING:  # pragma: no cover
    from splitserve.engine.llm import LLM, AsyncLLM
    from splitserve.engine.request import GenerationResult
    from splitserve.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'splitserve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
