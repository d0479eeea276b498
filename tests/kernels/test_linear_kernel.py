"""Decode-batch linear kernel (kernels/linear.py, the LM head) against its torch
reference (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from splitserve.kernels.linear import LinearConfig, decode_linear, linear_reference  # noqa: E402


@pytest.mark.parametrize(
    "rows,n,k,config",
    [
        (1, 64, 128, LinearConfig(64, 64)),
        (5, 96, 256, LinearConfig(64, 64)),  # N not a multiple of the tile
        (17, 200, 96, LinearConfig(64, 64)),  # K not a multiple of the tile
        (64, 128, 256, None),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_linear_matches_reference(rows, n, k, config, dtype, device):
    g = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=g).to(dtype).to(device)
    w = (0.1 * torch.randn(n, k, generator=g)).to(dtype).to(device)
    got = decode_linear(x, w, config=config)
    want = linear_reference(x, w)
    assert got.dtype == dtype and got.shape == (rows, n)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    else:  # one rounding of the fp32 sum, in another order
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_decode_linear_fp32_out_from_half_inputs(device):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 128, generator=g).half().to(device)
    w = (0.1 * torch.randn(80, 128, generator=g)).half().to(device)
    got = decode_linear(x, w, out_dtype=torch.float32, config=LinearConfig(64, 64))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, linear_reference(x, w, out_dtype=torch.float32), rtol=1e-3, atol=1e-3)


def test_decode_linear_rejects_bad_shapes(device):
    w = torch.zeros(8, 64, device=device)
    with pytest.raises(ValueError, match="does not fit"):
        decode_linear(torch.zeros(2, 32, device=device), w)
    with pytest.raises(ValueError, match="at most"):
        decode_linear(torch.zeros(65, 64, device=device), w)
