"""`kernels/_launch.py`: the cache key is at least as fine as Triton's own specialisation (a
cached compiled kernel is never reused for arguments Triton would compile differently), and
anything but a CUDA launch takes Triton's normal path."""

from __future__ import annotations

import torch

from splitserve.kernels._launch import FastLaunch, arg_key


def test_arg_key_separates_what_triton_specialises_on():
    assert arg_key(1) != arg_key(2)  # == 1 becomes a constant
    assert arg_key(16) != arg_key(17) and arg_key(16) == arg_key(32)  # divisible by 16
    assert arg_key(2**31 - 16) != arg_key(2**31 + 16)  # i32 vs i64
    assert arg_key(True) != arg_key(1)
    base = torch.zeros(64, dtype=torch.float16)
    assert arg_key(base) != arg_key(base[1:])  # 16-byte alignment of the pointer
    assert arg_key(base) != arg_key(torch.zeros(64, dtype=torch.float32))  # pointer dtype


class _Kernel:
    """Records launches the way `JITFunction.__getitem__` is called."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, args, kwargs))

        return launch


def test_cpu_arguments_take_the_plain_launch_every_time():
    kernel = _Kernel()
    launch = FastLaunch(kernel)
    x = torch.zeros(4)
    for n in (3, 4):
        launch((2, 1, 1), (x, n), {"BLOCK": 8}, 4)
    assert kernel.calls == [((2, 1, 1), (x, 3), {"BLOCK": 8, "num_warps": 4}),
                            ((2, 1, 1), (x, 4), {"BLOCK": 8, "num_warps": 4})]
