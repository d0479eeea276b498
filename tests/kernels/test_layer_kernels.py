"""Fused per-token layer kernels (RMSNorm + residual, rotary q/k, SwiGLU) against
their torch references (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from splitserve.engine.models.rope import RotaryEmbedding  # noqa: E402
from splitserve.kernels.activation import silu_and_mul, silu_and_mul_reference  # noqa: E402
from splitserve.kernels.argmax import argmax_rows  # noqa: E402
from splitserve.kernels.kv_write import write_kv_reference  # noqa: E402
from splitserve.kernels.norm import add_residual, embed_rms_norm, rms_norm, rms_norm_reference  # noqa: E402
from splitserve.kernels.rotary import apply_rotary_qk, apply_rotary_qk_and_write_kv, rotary_reference  # noqa: E402


def _close(got, want, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # fp16: summation order of the mean may flip one rounding
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("hidden,dtype", [(64, torch.float32), (96, torch.float16), (256, torch.float16)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(hidden, dtype, with_residual, device):
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, hidden, generator=g).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(device)
    res = torch.randn(5, hidden, generator=g).to(dtype).to(device) if with_residual else None
    want, want_res = rms_norm_reference(x, w, 1e-5, None if res is None else res.clone())
    got = rms_norm(x, w, 1e-5, res)
    _close(got, want, dtype)
    if with_residual:
        assert torch.equal(res, want_res)  # the residual sum is one exact rounding
    assert not torch.equal(got, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_embed_rms_norm_is_the_norm_of_the_gathered_rows(dtype, device):
    """The embedding lookup in the first norm's launch: the residual stream is table[ids]
    exactly, the normed rows equal rms_norm of them (repeated and out-of-order ids included)."""
    g = torch.Generator().manual_seed(11)
    table = torch.randn(50, 96, generator=g).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype).to(device)
    ids = torch.tensor([7, 0, 49, 7, 3], device=device)
    normed, residual = embed_rms_norm(ids, table, w, 1e-5)
    assert torch.equal(residual, table[ids])
    assert torch.equal(normed, rms_norm(table[ids], w, 1e-5))
    empty, empty_res = embed_rms_norm(ids[:0], table, w, 1e-5)
    assert empty.shape == empty_res.shape == (0, 96)
    with pytest.raises(ValueError, match="integer"):
        embed_rms_norm(ids.float(), table, w, 1e-5)


def test_rms_norm_rejects_bad_shapes(device):
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.zeros(2, 8, device=device), torch.ones(4, device=device), 1e-5)
    with pytest.raises(ValueError, match="partials"):  # partials need a residual to land in
        rms_norm(torch.zeros(2, 3, 8, device=device), torch.ones(8, device=device), 1e-5)


@pytest.mark.parametrize("parts", [1, 3])
def test_rms_norm_of_split_partials_is_the_norm_of_their_rounded_sum(parts, device):
    """x as fp32 split-K partials [S, T, H] (kernels.decode_linear_partials): the kernel sums them
    in order and rounds once, then adds the residual: bit for bit the plain call on that sum."""
    g = torch.Generator().manual_seed(parts)
    partials = torch.randn(parts, 5, 96, generator=g).to(device)
    w = (1 + 0.1 * torch.randn(96, generator=g)).half().to(device)
    res = torch.randn(5, 96, generator=g).half().to(device)
    x = partials[0].clone()
    for part in partials[1:]:
        x += part
    res_plain = res.clone()
    want = rms_norm(x.half(), w, 1e-5, res_plain)
    got = rms_norm(partials, w, 1e-5, res)
    assert got.dtype == torch.float16 and torch.equal(got, want) and torch.equal(res, res_plain)


@pytest.mark.parametrize("parts", [0, 1, 3])
def test_add_residual_is_the_residual_add_of_rms_norm(parts, device):
    """The end of a stage's layers: the residual stream updated exactly as `rms_norm(...,
    residual=)` updates it (partials summed in order, rounded, then added), with no norm."""
    g = torch.Generator().manual_seed(10 + parts)
    x = torch.randn(*((parts,) if parts else ()), 5, 96, generator=g)
    x = (x if parts else x.half()).to(device)
    res = torch.randn(5, 96, generator=g).half().to(device)
    summed = x[0].clone() if parts else x.float()
    for part in x[1:parts]:
        summed += part
    want = (summed.half().float() + res.float()).half()
    res_norm = res.clone()
    rms_norm(x, torch.ones(96, dtype=torch.float16, device=device), 1e-5, res_norm)
    got = add_residual(x, res)
    assert got is res and torch.equal(res, want) and torch.equal(res, res_norm)
    with pytest.raises(ValueError, match="residual"):
        add_residual(x, None)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,dtype", [(4, 2, 16, torch.float32), (8, 1, 64, torch.float16), (3, 3, 48, torch.float32)]
)
def test_rotary_qk_matches_reference_on_fused_views(heads, kv_heads, head_dim, dtype, device):
    g = torch.Generator().manual_seed(heads * head_dim)
    t = 7
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(device)
    q = qkv[:, : heads * head_dim].view(t, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    rope = RotaryEmbedding(head_dim, 10000.0, None).to(device)
    cos, sin = rope.cos_sin(torch.tensor([0, 1, 5, 9, 30, 31, 100], device=device), dtype)
    want_q, want_k = rotary_reference(q, cos, sin), rotary_reference(k, cos, sin)
    apply_rotary_qk(q, k, cos, sin)
    if dtype == torch.float32 and q.device.type == "cpu":
        assert torch.equal(q, want_q) and torch.equal(k, want_k)
    elif dtype == torch.float32:  # the GPU compiler fuses x*cos - y*sin into an FMA: one rounding fewer
        torch.testing.assert_close(q, want_q, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(k, want_k, rtol=1e-6, atol=1e-6)
    else:
        _close(q, want_q, dtype)
        _close(k, want_k, dtype)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("inter,dtype", [(48, torch.float32), (1500, torch.float16)])
def test_silu_and_mul_matches_reference(inter, dtype, device):
    g = torch.Generator().manual_seed(inter)
    x = torch.randn(3, 2 * inter, generator=g).to(dtype).to(device)
    got = silu_and_mul(x)
    want = silu_and_mul_reference(x)
    assert got.shape == (3, inter)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        _close(got, want, dtype)


@pytest.mark.parametrize("vocab,dtype", [(1000, torch.float32), (9000, torch.float16), (4096 * 3 + 5, torch.float32)])
def test_argmax_rows_matches_torch_first_index_on_ties(vocab, dtype, device):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(4, vocab, generator=g).to(dtype)
    x[1, 17] = x[1, vocab - 3] = 50.0  # a tie across slices: the first index wins
    x[2] = 0.0  # all equal: index 0
    x[3, vocab - 1] = 99.0  # the last entry
    x = x.to(device)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("dtype,d", [(torch.float32, 16), (torch.float16, 16), (torch.float32, 48)])
def test_rotary_and_kv_write_in_one_launch(dtype, d, device):
    """= apply_rotary_qk, then write_kv of the rotated k and of v (a negative slot skipped)."""
    g = torch.Generator().manual_seed(3)
    t, heads, kv_heads, bs = 5, 4, 2, 4
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype).to(device)
    q = qkv[:, : heads * d].view(t, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
    cos, sin = RotaryEmbedding(d, 10000.0, None).to(device).cos_sin(torch.arange(3, 3 + t, device=device), dtype)
    kv = torch.randn(2, 6, kv_heads, bs, d, generator=g).to(dtype).to(device)
    slots = torch.tensor([0, 7, -1, 13, 22], device=device)
    want_q, want_k = rotary_reference(q, cos, sin), rotary_reference(k, cos, sin)
    want_kv = kv.clone()
    write_kv_reference(want_kv, want_k, v, slots)
    apply_rotary_qk_and_write_kv(q, k, v, cos, sin, kv, slots)
    _close(q, want_q, dtype)
    _close(k, want_k, dtype)
    _close(kv, want_kv, dtype)
