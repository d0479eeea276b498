"""RMSNorm carried by the decode projections (kernels/carried_norm.py): a producer adds its product
into the residual stream and sums each row's squares per tile; a consumer normalizes the residual
it reads by those sums. Against the add+RMSNorm kernel and the plain projections (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from splitserve.kernels.carried_norm import RowNorm  # noqa: E402
from splitserve.kernels.elementwise_reference import rms_norm_reference  # noqa: E402
from splitserve.kernels.linear import (  # noqa: E402
    LinearConfig,
    decode_linear,
    decode_linear_glu,
    decode_linear_into_residual,
    decode_linear_partials,
)
from splitserve.kernels.norm import rms_norm  # noqa: E402
from splitserve.kernels.qkv_rotary import decode_qkv_rotary  # noqa: E402


def _tensors(rows, n, k, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype).to(device)
    w = (0.1 * torch.randn(n, k, generator=g)).to(dtype).to(device)
    residual = torch.randn(rows, n, generator=g).to(dtype).to(device)
    return x, w, residual


def _tile_sums(residual, tile):
    """Per-tile sums of squares [tiles, rows] of residual [rows, N] (N padded to whole tiles)."""
    r = residual.float()
    pad = -r.shape[1] % tile
    r = torch.nn.functional.pad(r, (0, pad))
    return (r * r).view(r.shape[0], -1, tile).sum(-1).t().contiguous()


@pytest.mark.parametrize("rows,n,k,config", [(1, 40, 64, LinearConfig(16, 32)), (9, 70, 96, LinearConfig(32, 32, 4, 2))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_whole_producer_adds_into_the_residual_and_sums_its_tiles(rows, n, k, config, dtype, device):
    x, w, residual = _tensors(rows, n, k, dtype, device, seed=rows + n)
    want = (decode_linear(x, w, config=config).float() + residual.float()).to(dtype)  # the norm kernel's add
    got = residual.clone()
    stats = decode_linear_into_residual(x, w, got, config)
    assert torch.equal(got, want)
    assert stats.shape == (-(-n // config[0]), rows) and stats.dtype == torch.float32
    torch.testing.assert_close(stats, _tile_sums(want, config[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k,splits", [(256, 4), (300, 3)])
def test_split_producer_sums_partials_as_the_norm_kernel_does(k, splits, device):
    """The last range of each tile sums the partials in order and rounds once: the residual is
    bit for bit what rms_norm(partials, residual=...) leaves; the counters are zero again, so the
    same buffer serves the next launch (as in a replayed CUDA graph)."""
    config = LinearConfig(16, 64, 4, 2, splits=splits)
    x, w, residual = _tensors(6, 40, k, torch.float16, device, seed=k)
    want = residual.clone()
    rms_norm(decode_linear_partials(x, w, config), torch.ones(40, dtype=torch.float16, device=device), 1e-5, want)
    counters = torch.zeros(8, dtype=torch.int32, device=device)
    for _ in range(2):
        got = residual.clone()
        stats = decode_linear_into_residual(x, w, got, config, counters)
        assert torch.equal(got, want)
        assert not counters.any()
        torch.testing.assert_close(stats, _tile_sums(want, 16), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="counters"):
        decode_linear_into_residual(x, w, residual.clone(), config, torch.zeros(2, dtype=torch.int32, device=device))


@pytest.mark.parametrize("tile", [16, 5, 1])  # 1: 48 tiles, the stats read in several blocks of parts
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_consumers_normalize_the_residual_as_the_norm_kernel_does(tile, dtype, device):
    rows, hidden = 7, 48
    g = torch.Generator().manual_seed(tile)
    residual = (3 * torch.randn(rows, hidden, generator=g)).to(dtype).to(device)
    gamma = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(device)
    norm = RowNorm(_tile_sums(residual, tile), gamma, 1e-5)
    normed = rms_norm_reference(residual, gamma, 1e-5)[0]
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    w = (0.1 * torch.randn(2 * 40, hidden, generator=g)).to(dtype).to(device)
    config = LinearConfig(32, 16, 4, 2)
    got = decode_linear_glu(residual, w, config, norm=norm)
    torch.testing.assert_close(got.float(), decode_linear_glu(normed, w, config).float(), rtol=tol, atol=tol)
    hq, hk, d = 2, 1, 16
    wq = (0.1 * torch.randn((hq + 2 * hk) * d, hidden, generator=g)).to(dtype).to(device)
    angles = torch.rand(rows, d // 2, generator=g) * 6.0
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype).to(device)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype).to(device)
    kv = torch.zeros(2, 4, hk, 4, d, dtype=dtype, device=device)
    slots = torch.arange(rows, device=device)
    kv_want = kv.clone()
    q_want = decode_qkv_rotary(normed, wq, cos, sin, kv_want, slots, hq, LinearConfig(32, 16))
    q = decode_qkv_rotary(residual, wq, cos, sin, kv, slots, hq, LinearConfig(32, 16), norm=norm)
    torch.testing.assert_close(q.float(), q_want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(kv.float(), kv_want.float(), rtol=tol, atol=tol)


def test_bad_norms_and_residuals_are_refused(device):
    x, w, residual = _tensors(3, 32, 64, torch.float32, device, seed=0)
    gamma = torch.ones(64, device=device)
    with pytest.raises(ValueError, match="stats"):
        decode_linear_glu(x, torch.cat([w, w]), norm=RowNorm(torch.zeros(2, 4, device=device), gamma, 1e-5))
    with pytest.raises(ValueError, match="norm weight"):
        decode_linear_glu(x, torch.cat([w, w]), norm=RowNorm(torch.zeros(2, 3, device=device), gamma[:5], 1e-5))
    with pytest.raises(ValueError, match="residual"):
        decode_linear_into_residual(x, w, residual[:, :5])
