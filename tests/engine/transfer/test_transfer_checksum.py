from __future__ import annotations

import pytest
import torch
from kvtransfer_helpers import block_tables, layout, random_logical, scatter

from splitserve.engine.transfer.checksum import Unit, tensor_checksum, unit_checksums, verify_unit_checksums


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_any_single_flipped_bit_changes_the_checksum(dtype):
    x = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0)).to(dtype)
    base = tensor_checksum(x)
    assert 0 <= base < 2**64
    raw = x.view(-1).view(torch.uint8)
    for byte in (0, 1, raw.numel() // 2, raw.numel() - 1):
        for bit in (0, 7):
            y = raw.clone()
            y[byte] ^= 1 << bit
            assert tensor_checksum(y.view(dtype)) != base, (byte, bit)


def test_checksum_is_order_sensitive_and_deterministic():
    x = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    assert tensor_checksum(x) == tensor_checksum(x.clone())
    assert tensor_checksum(x) != tensor_checksum(x.flip(0))
    assert tensor_checksum(x[:, :4]) == tensor_checksum(x[:, :4].contiguous())


def test_units_are_the_same_on_every_layout():
    num_blocks, pool = 4, 7
    logical = random_logical(layout(1, 1, 2), num_blocks, seed=1)
    results = []
    for tp, pp in [(1, 1), (2, 1), (4, 2), (1, 2)]:
        lay = layout(tp, pp, 2)
        tables = block_tables(lay, num_blocks, pool, seed=tp * 10 + pp)
        kv = scatter(logical, lay, tables, pool)
        merged: dict[Unit, int] = {}
        for rank in range(lay.world_size):
            units = unit_checksums(kv[rank], lay, rank, tables[rank], first_block=1)
            assert not set(units) & set(merged)
            merged |= units
        results.append(merged)
    assert sorted(results[0]) == [Unit(layer, head) for layer in range(3) for head in range(2)]
    assert all(r == results[0] for r in results)
    # The cached prefix is not part of any unit; the units' content is.
    assert results[0] != {u: v for u, v in unit_checksums(
        scatter(logical, layout(1, 1, 2), {0: [0, 1, 2, 3]}, pool)[0], layout(1, 1, 2), 0, [0, 1, 2, 3]).items()}


def test_verify_reports_missing_and_replica_mismatches():
    lay = layout(4, 1, 2)
    tables = {rank: [0, 1] for rank in range(4)}
    kv = scatter(random_logical(lay, 2, seed=2), lay, tables, 3)
    expected = unit_checksums(kv[0], lay, 0, tables[0])
    assert unit_checksums(kv[1], lay, 1, tables[1]) == {}  # a non-primary replica reports nothing
    assert verify_unit_checksums(kv[1], lay, 1, tables[1], expected) == []  # ...but verifies its copy
    kv[1][2][1, 1, 0, 1, 3] = 123.0
    assert verify_unit_checksums(kv[1], lay, 1, tables[1], expected) == [(2, 0)]
    assert verify_unit_checksums(kv[2], lay, 2, tables[2], expected) == [(0, 1), (1, 1), (2, 1)]
    with pytest.raises(ValueError, match=r"first_block 3 out of range \[0, 2\]"):
        unit_checksums(kv[0], lay, 0, tables[0], first_block=3)
