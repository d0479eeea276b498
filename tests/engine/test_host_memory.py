"""CPU KV pools ask for transparent huge pages (engine/host_memory.py): NIXL's same-host reads pin
the source's pages one by one, and 2 MiB pages made them 1.3-1.5x faster here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from splitserve.engine.host_memory import HUGE_PAGE, huge_page_empty, huge_page_zeros
from splitserve.engine.kv_cache import allocate_kv_caches


def _vma_flags(addr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding `addr`."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and ":" in head:
            fields[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return fields


def _thp_mode() -> str:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    text = path.read_text() if path.exists() else ""
    return text[text.find("[") + 1:text.find("]")] if "[" in text else "unavailable"


def test_large_tensors_start_on_a_huge_page_boundary_and_small_ones_are_plain():
    big = huge_page_zeros((3, 1 << 20), torch.float32)
    assert big.shape == (3, 1 << 20) and big.dtype == torch.float32 and big.is_contiguous()
    assert big.data_ptr() % HUGE_PAGE == 0 and int(big.count_nonzero()) == 0
    big.fill_(2.5)  # the whole view is writable memory of its own
    assert float(big.sum()) == 2.5 * 3 * (1 << 20)
    small = huge_page_empty(100, torch.bfloat16)
    assert small.shape == (100,) and small.storage_offset() == 0


def test_the_cpu_kv_pool_is_advised_for_huge_pages():
    if _thp_mode() not in ("madvise", "always"):
        pytest.skip(f"transparent huge pages are {_thp_mode()} here")
    kv = allocate_kv_caches(2, 64, 4, 16, 64, torch.float32, torch.device("cpu"))
    for t in kv:
        assert t.data_ptr() % HUGE_PAGE == 0
        flags = _vma_flags(t.data_ptr())
        assert flags.get("THPeligible") == "1", flags
