"""Mamba2 (SSD) kernels against their torch references, and the references against
the plain token-by-token recurrence (fp32 and fp16; the CPU interpreter has no bf16)."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels import ssm_reference as ref


def _case(length, heads, head_dim, groups, state, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    return dict(
        x=rnd(length, heads, head_dim).to(dtype),
        dt=rnd(length, heads, scale=0.5).to(dtype),
        A=-torch.arange(1, heads + 1, dtype=torch.float32, device=device) * 0.5,
        B=rnd(length, groups, state, scale=0.5).to(dtype),
        C=rnd(length, groups, state, scale=0.5).to(dtype),
        D=rnd(heads),
        dt_bias=rnd(heads, scale=0.5),
    )


def _sequential(c, initial, dt_min):
    """The recurrence one token at a time, with the decode reference."""
    heads, head_dim = c["x"].shape[1:]
    state = initial.clone()[None]
    slots = torch.zeros(1, dtype=torch.long)
    ys = []
    for t in range(c["x"].shape[0]):
        ys.append(ref.selective_state_update_reference(
            state, c["x"][t : t + 1], c["dt"][t : t + 1], c["A"], c["B"][t : t + 1], c["C"][t : t + 1],
            c["D"], c["dt_bias"], slots, dt_min,
        ))
    return torch.cat(ys), state[0]


@pytest.mark.parametrize("length, chunk", [(1, 16), (37, 16), (64, 32), (50, 8)])
def test_chunk_scan_reference_equals_the_recurrence(length, chunk):
    c = _case(length, 4, 8, 2, 16, torch.float32, "cpu", seed=length)
    initial = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(3))
    y, final = ref.ssd_chunk_scan_reference(**c, chunk_size=chunk, initial_state=initial, dt_min=0.01)
    y_seq, final_seq = _sequential(c, initial, 0.01)
    torch.testing.assert_close(y, y_seq, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, final_seq, atol=1e-4, rtol=1e-4)


def test_conv_reference_in_pieces_equals_whole_and_the_update():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(20, 12, generator=g), torch.randn(12, 4, generator=g), torch.randn(12, generator=g)
    zero = torch.zeros(12, 3)
    whole, state_whole = ref.causal_conv1d_reference(x, w, b, zero)
    first, state = ref.causal_conv1d_reference(x[:7], w, b, zero)
    rest, state = ref.causal_conv1d_reference(x[7:], w, b, state)
    torch.testing.assert_close(torch.cat([first, rest]), whole)
    torch.testing.assert_close(state, state_whole)
    pool = torch.zeros(3, 12, 3)
    steps = [ref.causal_conv1d_update_reference(x[t : t + 1], pool, w, b, torch.tensor([1])) for t in range(20)]
    torch.testing.assert_close(torch.cat(steps), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[1], state_whole)
    assert pool[0].abs().sum() == 0 and pool[2].abs().sum() == 0


TOL = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.float16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads, head_dim, groups, state", [(4, 8, 2, 16), (6, 40, 3, 24)])
def test_selective_state_update_kernel_matches_reference(device, dtype, heads, head_dim, groups, state):
    from splitserve.kernels import selective_state_update

    batch = 3
    c = _case(batch, heads, head_dim, groups, state, dtype, device, seed=heads)
    pool = torch.randn(5, heads, head_dim, state, generator=torch.Generator().manual_seed(1)).to(device)
    slots = torch.tensor([4, 0, 2], device=device)
    want_pool = pool.clone()
    want = ref.selective_state_update_reference(want_pool, **c, slots=slots, dt_min=0.001)
    got = selective_state_update(pool, **c, slots=slots, dt_min=0.001)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    torch.testing.assert_close(pool, want_pool, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("length, chunk, has_init", [(1, 16, False), (45, 16, True), (64, 32, True), (20, 8, False)])
def test_ssd_chunk_scan_kernel_matches_reference(device, dtype, length, chunk, has_init):
    from splitserve.kernels import ssd_chunk_scan

    c = _case(length, 4, 24, 2, 16, dtype, device, seed=length)
    init = torch.randn(4, 24, 16, generator=torch.Generator().manual_seed(2)).to(device) if has_init else None
    want_y, want_state = ref.ssd_chunk_scan_reference(**c, chunk_size=chunk, initial_state=init, dt_min=0.001)
    got_y, got_state = ssd_chunk_scan(**c, chunk_size=chunk, initial_state=init, dt_min=0.001)
    assert got_y.dtype == dtype and got_state.dtype == torch.float32
    torch.testing.assert_close(got_y.float(), want_y.float(), **TOL[dtype])
    torch.testing.assert_close(got_state, want_state, **TOL[dtype])


def _conv_case(channels, taps, dtype, device, has_bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(channels, taps, generator=g).to(dtype).to(device)
    bias = torch.randn(channels, generator=g).to(dtype).to(device) if has_bias else None
    return weight, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("channels, taps, has_bias", [(48, 4, True), (200, 4, False), (9, 2, True), (33, 3, True)])
def test_conv_update_kernel_matches_reference(device, dtype, channels, taps, has_bias):
    """Decode: one input per sequence at its slot (slots out of order, one slot untouched), fp32
    state beside fp16 inputs, channel counts across and below one block."""
    from splitserve.kernels import causal_conv1d_update

    weight, bias = _conv_case(channels, taps, dtype, device, has_bias, seed=channels)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, channels, generator=g).to(dtype).to(device)
    pool = torch.randn(4, channels, taps - 1, generator=g).to(device)
    slots = torch.tensor([3, 0, 2], device=device)
    want_pool = pool.clone()
    want = ref.causal_conv1d_update_reference(x, want_pool, weight, bias, slots)
    got = causal_conv1d_update(x, pool, weight, bias, slots)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    torch.testing.assert_close(pool, want_pool, **TOL[torch.float32])
    assert torch.equal(pool[1], want_pool[1])  # no sequence there


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("length, channels, taps", [(1, 40, 4), (2, 40, 4), (3, 130, 4), (37, 40, 4), (21, 17, 2)])
def test_conv_prefill_kernel_matches_reference(device, dtype, length, channels, taps):
    """Prefill: prompts shorter than the state (the new state keeps old columns), one block of
    tokens and several, a strided input (a slice of the projection's output, as the model passes)."""
    from splitserve.kernels import causal_conv1d

    weight, bias = _conv_case(channels, taps, dtype, device, True, seed=length)
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(length, channels + 11, generator=g).to(dtype).to(device)
    x = wide[:, 5:5 + channels]
    state = torch.randn(channels, taps - 1, generator=g).to(device)
    before = state.clone()
    want_y, want_state = ref.causal_conv1d_reference(x, weight, bias, state)
    got_y, got_state = causal_conv1d(x, weight, bias, state)
    assert got_y.dtype == dtype and got_state.dtype == state.dtype
    torch.testing.assert_close(got_y.float(), want_y.float(), **TOL[dtype])
    torch.testing.assert_close(got_state, want_state, **TOL[dtype])
    assert torch.equal(state, before)  # only read
