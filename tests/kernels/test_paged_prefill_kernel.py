"""Triton paged prefill (extend) attention against its torch reference (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import random_paged_case, tolerance  # noqa: E402

from splitserve.kernels.paged_prefill import paged_prefill_attention, paged_prefill_reference  # noqa: E402

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])

# (block_size, head_dim, num_kv_heads, group)
SHAPES = [
    (16, 64, 2, 4),
    (16, 64, 2, 1),
    (16, 32, 1, 2),
    (16, 128, 1, 4),
    (8, 64, 1, 2),
    (16, 80, 1, 3),  # not powers of two: padded head dim, 3 q heads per kv head
]


def _seqs(block_size: int) -> list[tuple[int, int]]:
    """(q_len, ctx_len): whole prompt, chunk over a cached prefix (ragged and on a
    block boundary), a single token, an empty chunk, a one-token prompt."""
    return [(19, 19), (9, 2 * block_size + 9), (1, block_size), (0, 5), (block_size, 2 * block_size), (1, 1)]


def _run(shape, dtype, device, *, block_m=None, block_n=None, index_dtype=torch.int32, seed=0):
    block_size, head_dim, num_kv_heads, group = shape
    seqs = _seqs(block_size)
    case = random_paged_case(
        [c for _, c in seqs],
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        device,
        seed=seed,
        index_dtype=index_dtype,
    )
    q_starts = torch.tensor([0] + [n for n, _ in seqs]).cumsum(0).to(index_dtype).to(device)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(int(q_starts[-1]), num_kv_heads * group, head_dim, generator=g).to(dtype).to(device)
    scale = head_dim**-0.5
    out = paged_prefill_attention(
        q, case.kv, case.block_tables, q_starts, case.ctx_lens, scale, block_m=block_m, block_n=block_n
    )
    expected = paged_prefill_reference(q, case.kv, case.block_tables, q_starts, case.ctx_lens, scale)
    tol = tolerance(dtype)
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "bs{}-d{}-hkv{}-g{}".format(*s))
def test_small_tiles_match_reference(shape, dtype, device):
    # 16-row tiles and 16-key steps: several q tiles and key steps per sequence.
    _run(shape, dtype, device, block_m=16, block_n=16, index_dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_default_tiles_match_reference(dtype, device):
    _run((16, 64, 2, 4), dtype, device, seed=1)


def test_strided_q_from_fused_projection(device):
    """q may be a view of a fused qkv output (token stride > Hq * D)."""
    case = random_paged_case([12, 30], 1, 32, 16, torch.float32, device, seed=5)
    qkv = torch.randn(12 + 6, 2 * 32 + 2 * 32, device=device)
    q = qkv[:, : 2 * 32].view(-1, 2, 32)
    q_starts = torch.tensor([0, 12, 18], device=device)
    out = paged_prefill_attention(
        q, case.kv, case.block_tables, q_starts, case.ctx_lens, 0.2, block_m=16, block_n=16
    )
    expected = paged_prefill_reference(q, case.kv, case.block_tables, q_starts, case.ctx_lens, 0.2)
    torch.testing.assert_close(out, expected, atol=1e-3, rtol=1e-3)
