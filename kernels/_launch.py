"""Relaunch a compiled Triton kernel without `JITFunction.run`'s per-call work.

`kernel[grid](...)` binds every argument, derives the specialisation key (int width, ==1,
divisible by 16; pointer dtype and 16-byte alignment) and looks the compiled kernel up on
every launch: ~60-90 µs of Python per launch on the H200 host (measured 2026-12-01), against
~140 µs of GPU time for a whole 8k-token handoff copy. `FastLaunch` keeps the `CompiledKernel`
that the first launch returned under a key that is at least as fine as Triton's own
specialisation of those arguments, and calls it directly afterwards (`CompiledKernel[grid]`,
the same launcher `JITFunction.run` ends in, with the same full argument list, constexprs
included). Anything unexpected (a Triton without that API, the interpreter) falls back to
the plain launch for good.
"""

from __future__ import annotations

import os

import torch


def arg_key(arg) -> tuple:
    """What Triton specialises one runtime argument on."""
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, bool) or not isinstance(arg, int):
        return (type(arg), arg)
    return (arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31, arg < 2**63)


class FastLaunch:
    """`launch(grid, args, constexprs, num_warps)` ≡ `kernel[grid](*args, **constexprs,
    num_warps=num_warps)`, where `args` are the runtime arguments in signature order and
    `constexprs` the rest in signature order (a dict, names as in the signature).

    `static_key`: a caller's cached stand-in for the specialisation of `args[:num_static]`
    (e.g. the `arg_key`s of a KV pool's tensors and strides, computed once per pool), so that
    only the arguments that change per call are keyed per call.
    """

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self._compiled: dict[tuple, object] = {}
        self._enabled = os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true")

    def __call__(
        self, grid: tuple[int, ...], args: tuple, constexprs: dict, num_warps: int,
        static_key: tuple | None = None, num_static: int = 0,
    ) -> None:
        if not self._enabled or not args[0].is_cuda:
            self.kernel[grid](*args, **constexprs, num_warps=num_warps)
            return
        if static_key is None:
            static_key, num_static = (args[0].device.index,), 0
        key = (static_key, num_warps, *constexprs.values(), *map(arg_key, args[num_static:]))
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, **constexprs, num_warps=num_warps)
            if hasattr(compiled, "__getitem__") and hasattr(compiled, "run"):
                if len(self._compiled) >= 64:
                    self._compiled.clear()
                self._compiled[key] = compiled
            else:
                self._enabled = False
            return
        compiled[grid](*args, *constexprs.values())
