"""In-place KV block checksums (every layer, one launch) against the torch forms (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from splitserve.kernels.kv_checksum import (  # noqa: E402
    kv_block_checksums,
    kv_block_checksums_reference,
)


def _pool(dtype, block_size, head_dim, layers=3, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 9, 3, block_size, head_dim, generator=g) * 100).to(dtype).to(device) for _ in range(layers)]


@pytest.mark.parametrize("dtype,block_size,head_dim", [(torch.float16, 16, 64), (torch.bfloat16, 4, 48)])
def test_block_checksums_match_reference(dtype, block_size, head_dim, device):
    kv = _pool(dtype, block_size, head_dim, device=device)
    blocks = torch.tensor([7, 0, 3, 3], device=device)
    heads = torch.tensor([2, 0], device=device)
    mult = torch.tensor([[5, 3], [11, 2], [(1 << 31) - 2, 7]], dtype=torch.int64, device=device)
    got = kv_block_checksums(kv, blocks, heads, mult)
    assert got.shape == (4, 2)
    assert torch.equal(got, kv_block_checksums_reference(kv, blocks, heads, mult))
    # one flipped bit in a V word of block 3, head 0, layer 1 changes exactly those blocks' sums
    kv[1].view(torch.int16)[1, 3, 0, block_size - 1, 5] ^= 1
    changed = (kv_block_checksums(kv, blocks, heads, mult) != got).any(-1)
    assert changed.tolist() == [False, False, True, True]


def test_block_checksums_equal_the_engine_torch_form(device):
    """The engine's handoff checksums (engine/handoff_checksums.py) are the same numbers either way."""
    from splitserve.engine.handoff_checksums import partial_block_checksums
    from splitserve.engine.transfer.layout import KVLayout

    kv = _pool(torch.float16, 16, 32, layers=4, seed=1)
    layout = KVLayout(dtype="float16", block_size=16, tp=1, pp=1, num_layers=4, num_kv_heads=3, head_dim=32)
    blocks = [1, 8, 4]
    expected = partial_block_checksums(kv, layout, 0, blocks)  # CPU: the torch form
    heads = torch.arange(3)
    mult = torch.tensor([[layer * 3 + h + 1 for h in range(3)] for layer in range(4)], dtype=torch.int64)
    got = kv_block_checksums([t.to(device) for t in kv], torch.tensor(blocks, device=device), heads.to(device),
                             mult.to(device))
    assert torch.equal(got.cpu(), expected)


def test_block_checksums_reject_bad_input(device):
    kv = [torch.zeros(2, 1, 1, 4, 8, device=device)]
    with pytest.raises(ValueError, match="16-bit"):
        kv_block_checksums(kv, torch.tensor([0]), torch.tensor([0]), torch.ones(1, 1, dtype=torch.int64))
    kv = [torch.zeros(2, 1, 1, 4, 8, dtype=torch.float16, device=device)]
    with pytest.raises(ValueError, match="multipliers"):
        kv_block_checksums(kv, torch.tensor([0]), torch.tensor([0]), torch.ones(2, 1, dtype=torch.int64))
