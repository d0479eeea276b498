"""Host (CPU) tensors backed by transparent huge pages, for memory another process reads.

NIXL moves DRAM between processes on one host through UCX's CMA transport
(`process_vm_readv`): the kernel pins the source's pages one by one for every read. On 4 KiB
pages that pinning held a pull to ~60-70% of a one-thread memcpy; on 2 MiB pages it runs at
86-104% (`THP_MEM_ALLOC_ENABLE=0/1 python benchmarks/handoff.py --transports nixl_packed`,
benchmarks/RESULTS.md 2026-12-03). Most distributions set transparent huge pages to `madvise`
(only regions that ask get them), so the KV pool, the NIXL arena and staging buffers ask: the
allocation is padded by 2 MiB, its 2 MiB-aligned part is advised `MADV_HUGEPAGE` before any
page is touched, and that part is returned. Where the call is unavailable (not Linux) or
refused, the memory is ordinary pages — only the speed differs.
"""

from __future__ import annotations

import ctypes
import math
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h

_libc = None


def _madvise(addr: int, length: int) -> bool:
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def huge_page_empty(shape: tuple[int, ...] | int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor whose memory asked for huge pages (small tensors,
    under 2 MiB, are plain `torch.empty`)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # glibc maps it fresh: no page touched yet
    start = -raw.data_ptr() % HUGE_PAGE
    _madvise(raw.data_ptr() + start, nbytes - nbytes % HUGE_PAGE)
    return raw[start:start + nbytes].view(dtype).view(shape)


def huge_page_zeros(shape: tuple[int, ...] | int, dtype: torch.dtype) -> torch.Tensor:
    return huge_page_empty(shape, dtype).zero_()
