"""The torch references against dense attention over the original (unpaged) K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import random_paged_case

from splitserve.kernels.reference import paged_decode_reference, paged_prefill_reference, write_kv_reference


def _dense(q, k, v, scale, mask):
    """q [Hq, M, D], k/v [L, Hkv, D] -> SDPA in fp64 with GQA."""
    return F.scaled_dot_product_attention(
        q.double(),
        k.transpose(0, 1).double(),
        v.transpose(0, 1).double(),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_reference_matches_dense_sdpa(block_size, group):
    ctx_lens = [1, block_size, 3 * block_size, 2 * block_size + 3]
    case = random_paged_case(
        ctx_lens, 2, 32, block_size, torch.float32, torch.device("cpu"), seed=block_size + group
    )
    q = torch.randn(len(ctx_lens), 2 * group, 32)
    out = paged_decode_reference(q, case.kv, case.block_tables, case.ctx_lens, 0.3)
    for b in range(len(ctx_lens)):
        expected = _dense(q[b][:, None], case.keys[b], case.values[b], 0.3, None)[:, 0]
        torch.testing.assert_close(out[b].double(), expected, atol=1e-5, rtol=1e-5)


def test_decode_reference_empty_context_gives_zeros():
    case = random_paged_case([0, 5], 1, 16, 4, torch.float32, torch.device("cpu"))
    out = paged_decode_reference(torch.randn(2, 2, 16), case.kv, case.block_tables, case.ctx_lens, 1.0)
    assert torch.equal(out[0], torch.zeros(2, 16))
    assert out[1].abs().sum() > 0


@pytest.mark.parametrize("group", [1, 2])
def test_prefill_reference_matches_dense_sdpa(group):
    # (q_len, ctx_len): whole prompt, chunk over a cached prefix, one token, empty.
    seqs = [(7, 7), (5, 21), (1, 16), (0, 8), (16, 32)]
    case = random_paged_case([c for _, c in seqs], 2, 32, 8, torch.float32, torch.device("cpu"), seed=group)
    q_starts = torch.tensor([0] + [n for n, _ in seqs]).cumsum(0)
    q = torch.randn(int(q_starts[-1]), 2 * group, 32)
    out = paged_prefill_reference(q, case.kv, case.block_tables, q_starts, case.ctx_lens, 0.2)
    for s, (q_len, ctx_len) in enumerate(seqs):
        if q_len == 0:
            continue
        qs = q[q_starts[s] : q_starts[s + 1]].transpose(0, 1)
        if q_len == ctx_len:
            expected = F.scaled_dot_product_attention(
                qs.double(),
                case.keys[s].transpose(0, 1).double(),
                case.values[s].transpose(0, 1).double(),
                is_causal=True,
                scale=0.2,
                enable_gqa=True,
            )
        else:
            mask = torch.ones(q_len, ctx_len, dtype=torch.bool).tril(ctx_len - q_len)
            expected = _dense(qs, case.keys[s], case.values[s], 0.2, mask)
        torch.testing.assert_close(
            out[q_starts[s] : q_starts[s + 1]].double(), expected.transpose(0, 1), atol=1e-5, rtol=1e-5
        )


def test_write_kv_reference_matches_per_token_copy():
    kv = torch.zeros(2, 6, 2, 4, 8)
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([13, 0, -1, 23, 4])
    write_kv_reference(kv, k, v, slots)
    expected = torch.zeros_like(kv)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[0, slot // 4, :, slot % 4] = k[t]
            expected[1, slot // 4, :, slot % 4] = v[t]
    assert torch.equal(kv, expected)
