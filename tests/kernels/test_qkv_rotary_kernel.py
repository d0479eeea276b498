"""The qkv projection with rotary and the KV write in its epilogue (kernels/qkv_rotary.py)
against the unfused torch reference: projection, rotate_half rotary, scatter into the cache."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from splitserve.kernels.elementwise_reference import rotary_reference  # noqa: E402
from splitserve.kernels.linear import LinearConfig, linear_reference  # noqa: E402
from splitserve.kernels.qkv_rotary import decode_qkv_rotary  # noqa: E402
from splitserve.kernels.reference import write_kv_reference  # noqa: E402


def _case(rows, hq, hk, d, k, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype).to(device)
    w = (0.1 * torch.randn((hq + 2 * hk) * d, k, generator=g)).to(dtype).to(device)
    angles = torch.rand(rows, d // 2, generator=g) * 6.0
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype).to(device)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype).to(device)
    kv = torch.randn(2, 6, hk, 4, d, generator=g).to(dtype).to(device)
    slots = torch.randperm(24, generator=g)[:rows].to(device)
    if rows > 1:
        slots[1] = -1  # a padding row of a graph batch: its cache slot stays untouched
    return x, w, cos, sin, kv, slots


def _reference(x, w, cos, sin, kv, slots, hq, hk, d):
    qkv = linear_reference(x, w)
    q = qkv[:, : hq * d].reshape(-1, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].reshape(-1, hk, d)
    v = qkv[:, (hq + hk) * d :].reshape(-1, hk, d)
    kv = kv.clone()
    write_kv_reference(kv, rotary_reference(k, cos, sin), v, slots)
    return rotary_reference(q, cos, sin), kv


@pytest.mark.parametrize(
    "rows,hq,hk,d,k,config",
    [
        (1, 4, 2, 16, 64, LinearConfig(32, 32)),  # GQA, one row
        (7, 2, 1, 48, 96, LinearConfig(32, 64, 4, 2)),  # head_dim 48: pairs straddle heads and q / k / v
        (20, 4, 4, 32, 80, None),  # K not a multiple of the tile, 17..64 rows
        (5, 4, 2, 16, 64, LinearConfig(16, 32)),  # 8 pairs a program: a 16-row weight tile
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qkv_rotary_matches_the_unfused_steps(rows, hq, hk, d, k, config, dtype, device):
    x, w, cos, sin, kv, slots = _case(rows, hq, hk, d, k, dtype, device, seed=rows * d + k)
    want_q, want_kv = _reference(x, w, cos, sin, kv, slots, hq, hk, d)
    got_kv = kv.clone()
    got_q = decode_qkv_rotary(x, w, cos, sin, got_kv, slots, hq, config)
    assert got_q.shape == (rows, hq, d) and got_q.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got_q.float(), want_q.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_kv.float(), want_kv.float(), rtol=tol, atol=tol)
    if rows > 1:  # the padding row wrote nothing: every slot but the written ones is as it was
        written = torch.zeros(kv.shape[1] * kv.shape[3], dtype=torch.bool)
        written[slots[slots >= 0].cpu()] = True
        keep = ~written.view(kv.shape[1], kv.shape[3])
        assert torch.equal(got_kv.permute(0, 1, 3, 2, 4)[:, keep], kv.permute(0, 1, 3, 2, 4)[:, keep])


@pytest.mark.parametrize("rows", [1, 20])
def test_qkv_rotary_gathers_its_rows_from_tables_by_position(rows, device):
    """cos / sin as tables [P, D] (views of one [P, 2D] table, as `RotaryEmbedding.tables`) and
    positions: q and the cache bit for bit what the rows gathered by torch give."""
    hq, hk, d, k = 4, 2, 16, 64
    x, w, _, _, kv, slots = _case(rows, hq, hk, d, k, torch.float16, device, seed=rows)
    g = torch.Generator().manual_seed(5)
    angles = torch.rand(40, d // 2, generator=g) * 6.0
    table = torch.cat([angles.cos(), angles.cos(), angles.sin(), angles.sin()], dim=-1).half().to(device)
    cos_t, sin_t = table[:, :d], table[:, d:]
    positions = torch.randint(0, 40, (rows,), generator=g).to(device)
    want_kv, got_kv = kv.clone(), kv.clone()
    want_q = decode_qkv_rotary(x, w, cos_t[positions], sin_t[positions], want_kv, slots, hq, LinearConfig(32, 32))
    got_q = decode_qkv_rotary(x, w, cos_t, sin_t, got_kv, slots, hq, LinearConfig(32, 32), positions=positions)
    assert torch.equal(got_q, want_q) and torch.equal(got_kv, want_kv)
    with pytest.raises(ValueError, match="positions"):
        decode_qkv_rotary(x, w, cos_t, sin_t, kv, slots, hq, positions=positions[:0] if rows > 1 else positions.float())
    with pytest.raises(ValueError, match="cos"):
        decode_qkv_rotary(x, w, cos_t, sin_t[:5], kv, slots, hq, positions=positions)


def test_qkv_rotary_rejects_what_does_not_fit(device):
    x, w, cos, sin, kv, slots = _case(3, 4, 2, 16, 64, torch.float32, device, seed=1)
    with pytest.raises(ValueError, match="do not fit"):
        decode_qkv_rotary(x, w[1:], cos, sin, kv, slots, 4)
    with pytest.raises(ValueError, match="do not fit"):
        decode_qkv_rotary(x, w, cos, sin, kv, slots, 3)
    with pytest.raises(ValueError, match="cos"):
        decode_qkv_rotary(x, w, cos[:2], sin, kv, slots, 4)
    with pytest.raises(ValueError, match="slot_mapping"):
        decode_qkv_rotary(x, w, cos, sin, kv, slots[:2], 4)
    with pytest.raises(ValueError, match="unsplit"):
        decode_qkv_rotary(x, w, cos, sin, kv, slots, 4, LinearConfig(32, 32, splits=2))
    with pytest.raises(ValueError, match="kv must be"):
        decode_qkv_rotary(x, w, cos, sin, kv[0], slots, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qkv_rotary_of_the_folded_norm(dtype, device):
    """`norm=`: the projection of rms_norm(x) through weight * γ, each row's sums scaled by its
    1 / rms from the partial sums of its squares a `decode_linear_add` leaves (here three column
    tiles' sums, by torch)."""
    from splitserve.kernels.linear import RowNorm
    from splitserve.kernels.norm import rms_norm

    rows, hq, hk, d, k = 5, 4, 2, 16, 48
    x, w, cos, sin, kv, slots = _case(rows, hq, hk, d, k, dtype, device, seed=11)
    norm_w = (1 + 0.1 * torch.randn(k, generator=torch.Generator().manual_seed(2))).to(dtype).to(device)
    squares = torch.stack([c.float().square().sum(1) for c in x.split(16, dim=1)])
    want_kv = kv.clone()
    want_q = decode_qkv_rotary(rms_norm(x, norm_w, 1e-6), w, cos, sin, want_kv, slots, hq, LinearConfig(32, 32))
    got_kv = kv.clone()
    folded = (w.float() * norm_w.float()).to(dtype)
    got_q = decode_qkv_rotary(x, folded, cos, sin, got_kv, slots, hq, LinearConfig(32, 32), norm=RowNorm(1e-6, squares))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got_q.float(), want_q.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_kv.float(), want_kv.float(), rtol=tol, atol=tol)
    unnormed = decode_qkv_rotary(x, folded, cos, sin, kv.clone(), slots, hq, LinearConfig(32, 32))
    assert not torch.allclose(got_q.float(), unnormed.float(), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="do not fit"):
        decode_qkv_rotary(x, w, cos, sin, kv, slots, hq, norm=RowNorm(1e-6, squares[:, 1:]))
