"""Triton KV scatter against its torch reference (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from splitserve.kernels.kv_write import write_kv, write_kv_reference  # noqa: E402


@pytest.mark.parametrize(
    "block_size,num_heads,head_dim,dtype",
    [
        (16, 2, 64, torch.float32),
        (16, 8, 64, torch.float16),
        (8, 1, 128, torch.float32),
        (32, 3, 80, torch.float16),
    ],
)
def test_write_kv_matches_reference(block_size, num_heads, head_dim, dtype, device):
    g = torch.Generator().manual_seed(block_size + num_heads)
    num_blocks, num_tokens = 6, 13
    kv = torch.randn(2, num_blocks, num_heads, block_size, head_dim, generator=g).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[3] = -1  # a padding token: skipped
    # k and v are views of a fused projection, in fp32 (cast to the cache dtype on write).
    fused = torch.randn(num_tokens, 4 * num_heads * head_dim, generator=g).to(device)
    k = fused[:, num_heads * head_dim : 2 * num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    v = fused[:, 3 * num_heads * head_dim :].view(num_tokens, num_heads, head_dim)
    expected = kv.clone()
    write_kv_reference(expected, k, v, slots.to(device))
    write_kv(kv, k, v, slots.to(torch.int32).to(device))
    assert torch.equal(kv, expected)


def test_write_kv_then_engine_layout(device):
    """Slot = block * block_size + offset, as the engine's slot_mapping."""
    kv = torch.zeros(2, 4, 2, 4, 16, device=device)
    k = torch.arange(2 * 16, dtype=torch.float32, device=device).view(1, 2, 16)
    write_kv(kv, k, -k, torch.tensor([2 * 4 + 3], device=device))
    assert torch.equal(kv[0, 2, :, 3], k[0]) and torch.equal(kv[1, 2, :, 3], -k[0])
    assert int((kv != 0).sum()) == 2 * 2 * 16 - 2  # k[0, 0, 0] == 0
