"""In-place KV block checksum sums against the torch form the handoff used (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from splitserve.kernels.kv_checksum import kv_block_sums, kv_block_sums_reference  # noqa: E402


@pytest.mark.parametrize("dtype,block_size,head_dim", [(torch.float16, 16, 64), (torch.bfloat16, 4, 48)])
def test_block_sums_match_reference(dtype, block_size, head_dim, device):
    g = torch.Generator().manual_seed(block_size)
    kv = (torch.randn(2, 9, 3, block_size, head_dim, generator=g) * 100).to(dtype).to(device)
    blocks = torch.tensor([7, 0, 3, 3], device=device)
    heads = torch.tensor([2, 0], device=device)
    got = kv_block_sums(kv, blocks, heads)
    assert torch.equal(got, kv_block_sums_reference(kv, blocks, heads))
    # one flipped bit in a V word of block 3, head 0 changes exactly those two entries' s1
    kv.view(torch.int16)[1, 3, 0, block_size - 1, 5] ^= 1
    changed = kv_block_sums(kv, blocks, heads) != got
    assert changed[2:, 1, 0].all() and changed.sum() >= 2
    assert not changed[:2].any() and not changed[:, 0].any()


def test_block_sums_reject_other_dtypes(device):
    with pytest.raises(ValueError, match="16-bit"):
        kv_block_sums(torch.zeros(2, 1, 1, 4, 8, device=device), torch.tensor([0]), torch.tensor([0]))
