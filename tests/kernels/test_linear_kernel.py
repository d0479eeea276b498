"""Decode-batch linear kernel (kernels/linear.py, the LM head) against its torch
reference (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from splitserve.kernels.elementwise_reference import silu_and_mul_reference  # noqa: E402
from splitserve.kernels.linear import (  # noqa: E402
    LinearConfig,
    decode_linear,
    decode_linear_glu,
    decode_linear_partials,
    linear_reference,
)


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


@pytest.mark.parametrize("rows,n,config", [(1, 200, LinearConfig(64, 64)), (5, 96, LinearConfig(32, 64)),
                                           (64, 130, None)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_argmax_from_the_epilogue_is_torch_argmax_of_the_result(rows, n, config, out_dtype, device):
    """Per-tile partials merged: the first index of each row's maximum of the values as stored,
    ties inside a tile and across tiles included (duplicated weight rows give equal logits)."""
    g = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, 64, generator=g).abs()  # positive: a positive weight row's logit is large
    x[0::2, 0], x[1::2, 0] = 0.0, 1.0
    w = 0.1 * torch.randn(n, 64, generator=g)
    w[n - 1] = w[3] = w[40] = 0.5  # the same top value three times: two tiles, then the last tile
    w[70] = 0.0
    w[70, 0] = 100.0  # ... beaten at column 70 in odd rows only (x[:, 0] = 1 there)
    ids = torch.full((rows,), -1, dtype=torch.int64, device=device)
    got = decode_linear(x.half().to(device), w.half().to(device), out_dtype=out_dtype, config=config, argmax=ids)
    torch.testing.assert_close(ids, got.argmax(dim=-1), rtol=0, atol=0)
    want = torch.where(torch.arange(rows) % 2 == 1, 70, 3).to(device)
    torch.testing.assert_close(ids, want, rtol=0, atol=0)


@pytest.mark.parametrize("rows,config", [(5, LinearConfig(32, 64)), (64, None)])
def test_keep_rows_stores_only_the_flagged_rows_and_argmaxes_all(rows, config, device, monkeypatch):
    """A decode graph's greedy rows need only their argmax: rows flagged 0 are left unwritten
    (they keep what the allocation held, here a sentinel), the others equal the full result, and
    every row's argmax is taken as without the flags."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=g).half().to(device)
    w = (0.1 * torch.randn(150, 64, generator=g)).half().to(device)
    full_ids = torch.empty(rows, dtype=torch.int64, device=device)
    full = decode_linear(x, w, out_dtype=torch.float32, config=config, argmax=full_ids)
    keep = (torch.arange(rows) % 3 == 1).to(device)
    real_empty = torch.empty
    sentinel = 12345.0

    def empty_with_sentinel(*shape, dtype=None, device=None, **kwargs):
        t = real_empty(*shape, dtype=dtype, device=device, **kwargs)
        return t.fill_(sentinel) if dtype == torch.float32 and t.dim() == 2 and t.shape[1] == 150 else t

    monkeypatch.setattr(torch, "empty", empty_with_sentinel)
    ids = torch.full((rows,), -1, dtype=torch.int64, device=device)
    got = decode_linear(x, w, out_dtype=torch.float32, config=config, argmax=ids, keep_rows=keep.long())
    monkeypatch.undo()
    torch.testing.assert_close(ids, full_ids, rtol=0, atol=0)
    torch.testing.assert_close(got[keep], full[keep], rtol=0, atol=0)
    assert bool((got[~keep] == sentinel).all())


def test_keep_rows_must_be_an_integer_row_per_token(device):
    x, w = torch.zeros(2, 64, device=device), torch.zeros(8, 64, device=device)
    with pytest.raises(ValueError, match="integer"):
        decode_linear(x, w, keep_rows=torch.ones(2, device=device))
    with pytest.raises(ValueError, match=r"\[2\]"):
        decode_linear(x, w, keep_rows=torch.ones(3, dtype=torch.int64, device=device))


def test_argmax_wants_an_int64_row_per_token(device):
    x, w = torch.zeros(2, 64, device=device), torch.zeros(8, 64, device=device)
    with pytest.raises(ValueError, match="int64"):
        decode_linear(x, w, argmax=torch.zeros(2, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match=r"\[2\]"):
        decode_linear(x, w, argmax=torch.zeros(3, dtype=torch.int64, device=device))


def test_decode_linear_rejects_bad_shapes(device):
    w = torch.zeros(8, 64, device=device)
    with pytest.raises(ValueError, match="does not fit"):
        decode_linear(torch.zeros(2, 32, device=device), w)
    with pytest.raises(ValueError, match="at most"):
        decode_linear(torch.zeros(65, 64, device=device), w)


@pytest.mark.parametrize("kind", ["qkv", "o", "gate_up", "down"])
@pytest.mark.parametrize("rows", [1, 40])
def test_every_projection_config_of_the_table_computes_the_product(kind, rows, device):
    """The decoder-layer configs (`projection_config`'s table: 512-wide K tiles, 16-row N tiles)
    on shapes that are not multiples of their tiles, whichever device runs them."""
    from splitserve.kernels.projection_configs import PROJECTION_CONFIGS

    config = PROJECTION_CONFIGS[kind][rows > 16]
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 600, generator=g).half().to(device)
    w = (0.1 * torch.randn(70, 600, generator=g)).half().to(device)
    got = decode_linear(x, w, config=config) if config.splits == 1 else decode_linear_partials(x, w, config).sum(0)
    torch.testing.assert_close(got.float(), linear_reference(x, w).float(), rtol=1e-2, atol=1e-2)
    if kind == "gate_up":  # the step runs this config as SwiGLU in the projection's epilogue
        got = decode_linear_glu(x, w, config)
        torch.testing.assert_close(got.float(), silu_and_mul_reference(linear_reference(x, w)).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("k,splits,ranges", [(256, 4, 4), (300, 4, 3), (64, 4, 1)])
def test_split_partials_sum_to_the_product(k, splits, ranges, device):
    """Whole K tiles per range: a K of fewer tiles than `splits` gives fewer partials, none left unwritten."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(6, k, generator=g).to(device)
    w = (0.1 * torch.randn(40, k, generator=g)).to(device)
    parts = decode_linear_partials(x, w, LinearConfig(16, 64, 4, 2, splits=splits))
    assert parts.shape == (ranges, 6, 40) and parts.dtype == torch.float32
    torch.testing.assert_close(parts.sum(0), linear_reference(x, w), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="unsplit"):
        decode_linear(x, w, config=LinearConfig(16, 64, 4, 2, splits=splits))


def test_projections_stay_on_cublas_without_programmatic_dependent_launch(monkeypatch):
    from splitserve.kernels.projection_configs import projection_config

    assert projection_config("qkv", 1, torch.device("cpu")) is None  # no PDL off CUDA
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        monkeypatch.setenv("SPLITSERVE_PDL", "0")
        assert projection_config("qkv", 1, cuda) is None
        monkeypatch.setenv("SPLITSERVE_PDL", "2")
        assert projection_config("qkv", 65, cuda) is None  # past MAX_ROWS: a prefill, cuBLAS's
        assert projection_config("bogus", 1, cuda) is None


@pytest.mark.parametrize("rows,inter,k,config", [(1, 48, 128, LinearConfig(32, 64)), (9, 70, 96, LinearConfig(64, 32, 4, 2))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_glu_is_silu_and_mul_of_the_projection(rows, inter, k, config, dtype, device):
    """SwiGLU in the projection's epilogue: the gate and up halves of each tile, rounded as the
    unfused silu_and_mul(projection) rounds them; I not a multiple of the half tile."""
    g = torch.Generator().manual_seed(inter)
    x = torch.randn(rows, k, generator=g).to(dtype).to(device)
    w = (0.1 * torch.randn(2 * inter, k, generator=g)).to(dtype).to(device)
    got = decode_linear_glu(x, w, config)
    want = silu_and_mul_reference(linear_reference(x, w))
    assert got.shape == (rows, inter) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="unsplit"):
        decode_linear_glu(x, w, LinearConfig(32, 64, splits=2))
    with pytest.raises(ValueError, match="2 \\* I"):
        decode_linear_glu(x, w[1:], config)


@pytest.mark.parametrize("rows,hidden,k,inter,o_config,gu_config", [
    (1, 80, 48, 40, LinearConfig(16, 32, 4, 2), LinearConfig(32, 32, 4, 2)),  # hidden not a multiple of the tiles
    (19, 64, 96, 48, LinearConfig(32, 64, 4, 2), LinearConfig(64, 16, 4, 2)),
    (3, 80, 112, 40, LinearConfig(16, 32, 4, 2, splits=3), LinearConfig(32, 32, 4, 2)),  # the down form: split K
    (2, 560, 32, 24, LinearConfig(16, 32, 4, 2), LinearConfig(32, 64, 4, 2)),  # 35 partial sums: two loads of them
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_post_attention_norm_folded_into_the_projections(rows, hidden, k, inter, o_config, gu_config, dtype, device):
    """o projection + residual add + RMSNorm + gate_up + SwiGLU in two launches (the add and the
    norm's statistics in the first's epilogue; the second's weight times the norm's γ, its sums
    scaled by each row's 1 / rms) = the unfused `decode_linear`, `rms_norm(residual=)`,
    `decode_linear_glu`: the residual stream exactly, the activation up to where the roundings
    fall (γ's into the weights, 1 / rms after the sum: 1e-5 in fp32, fp16's 1e-2 as above)."""
    from splitserve.kernels.linear import RowNorm, arrivals, decode_linear_add
    from splitserve.kernels.norm import rms_norm

    g = torch.Generator().manual_seed(rows + hidden)
    x = torch.randn(rows, k, generator=g).to(dtype).to(device)
    w_o = (0.2 * torch.randn(hidden, k, generator=g)).to(dtype).to(device)
    residual = torch.randn(rows, hidden, generator=g).to(dtype).to(device)
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(device)
    w_gu = (0.1 * torch.randn(2 * inter, hidden, generator=g)).to(dtype).to(device)

    want_res = residual.clone()
    proj = decode_linear_partials(x, w_o, o_config) if o_config.splits > 1 else decode_linear(x, w_o, config=o_config)
    want = decode_linear_glu(rms_norm(proj, norm_w, 1e-5, residual=want_res), w_gu, gu_config)
    got_res = residual.clone()
    squares = decode_linear_add(x, w_o, got_res, o_config)
    if o_config.splits > 1:  # every column tile's count is back at 0 for the next launch
        assert not arrivals(got_res.device, -(-hidden // o_config[0])).any()
    assert squares.shape == (-(-hidden // o_config[0]), rows) and squares.dtype == torch.float32
    torch.testing.assert_close(squares.sum(0), got_res.float().square().sum(1), rtol=1e-5, atol=1e-5)
    assert torch.equal(got_res, want_res)
    folded = (w_gu.float() * norm_w.float()).to(dtype)
    got = decode_linear_glu(got_res, folded, gu_config, norm=RowNorm(1e-5, squares))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert not torch.allclose(got, decode_linear_glu(got_res, folded, gu_config), rtol=tol, atol=tol)  # scaled
    with pytest.raises(ValueError, match="does not fit"):
        decode_linear_add(x, w_o, residual[:, 1:], o_config)
    with pytest.raises(ValueError, match="do not fit"):
        decode_linear_glu(got_res, folded, gu_config, norm=RowNorm(1e-5, squares[:, 1:]))
