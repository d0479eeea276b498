"""Creating a NIXL agent (UCX backend) the way splitserve needs it: UCX pointed at loopback
unless told otherwise, and NIXL's progress thread given a poll timeout instead of a spin."""

from __future__ import annotations

import os
import sys
import threading
import types

#: Environment defaults applied (unless already set) before the first agent is created.
UCX_ENV_DEFAULTS = {
    "UCX_NET_DEVICES": "lo",  # never pick a routable interface on its own
    "NIXL_LOG_LEVEL": "WARN",  # NIXL logs every agent and backend creation at INFO
}

CUDA_UCX_ENV_DEFAULTS = {
    # UCX turns cuda_ipc's get_zcopy off on GPUs without an active NVLink ("cuda-ipc get zcopy
    # disabled as no nvlinks detected": reads were slower than writes on some PCIe platforms), and a
    # NIXL READ of VRAM then falls back to UCX's software emulation over TCP loopback — 0.5 GB/s
    # between two processes on one H200, against ~2,000 GB/s for a device copy. Decode workers pull
    # (READ), so on a GPU host we ask for it: benchmarks/RESULTS.md (2026-12-03, session 10).
    "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on",
}
"""Applied as well (unless set) when this process sees a CUDA device; without one UCX's cuda
module is not loaded and would warn that the variable is unused."""

PROGRESS_DELAY_US = 5000
"""Longest sleep of NIXL's progress thread between polls of its UCX worker's event fd (µs).
NIXL's Python API always asks for 0, which makes the thread spin: `poll()` with a zero timeout
in a loop, a whole core for the agent's life (it doubled a prefill's time on a shared core,
benchmarks/RESULTS.md). With a timeout the thread sleeps in `poll()` and UCX's event fd wakes it
as soon as there is work; the timeout only bounds NIXL's periodic re-check (a workaround for
wake-ups UCX may miss). `SPLITSERVE_NIXL_PROGRESS_DELAY_US` overrides it; 0 = NIXL's spin."""

_PATCH_LOCK = threading.Lock()


def apply_env_defaults() -> None:
    """Set `UCX_ENV_DEFAULTS` (and `CUDA_UCX_ENV_DEFAULTS` on a CUDA host) where the environment
    has no value yet; call before the first agent is created (UCX reads them then)."""
    defaults = dict(UCX_ENV_DEFAULTS)
    if _cuda_available():
        defaults.update(CUDA_UCX_ENV_DEFAULTS)
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def create_agent(nixl_agent, name: str, config, delay_us: int):
    """`nixl_agent(name, config)` with the progress thread's poll timeout at `delay_us`.

    The Python API builds its `nixlAgentConfig` inside the constructor and sets `pthrDelay = 0`
    there; for the constructor's duration its bindings module is swapped for one whose config
    class keeps `pthrDelay` at least `delay_us` (everything else is the real module). If the
    installed NIXL is not shaped like that, the agent is created as NIXL would (spinning)."""
    api = sys.modules.get(nixl_agent.__module__)
    bind = getattr(api, "nixlBind", None)
    base = getattr(bind, "nixlAgentConfig", None)
    field = vars(base).get("pthrDelay") if isinstance(base, type) else None
    if delay_us <= 0 or not isinstance(field, property):
        return nixl_agent(name, config)

    class DelayedConfig(base):
        @property
        def pthrDelay(self):  # noqa: N802 - NIXL's name
            return field.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value):  # noqa: N802
            field.__set__(self, max(int(value), delay_us))

    shim = types.SimpleNamespace(**vars(bind))
    shim.nixlAgentConfig = DelayedConfig
    with _PATCH_LOCK:
        api.nixlBind = shim
        try:
            return nixl_agent(name, config)
        finally:
            api.nixlBind = bind


def nixl_api():
    """The installed NIXL python API (`nixl-cu13` wheel, else the generic `nixl` package)."""
    try:
        from nixl_cu13 import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise ImportError("NIXL is not installed: pip install 'splitserve[nixl]' (nixl-cu13)") from exc
    return nixl_agent, nixl_agent_config
