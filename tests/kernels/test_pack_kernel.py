"""Triton head-range block copy (reshard pack / unpack) against its torch reference
(interpreter on CPU; fp32 and fp16)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from splitserve.kernels.pack import copy_head_block_runs, copy_head_blocks_reference  # noqa: E402


def _copy_by_ids(srcs, dsts, src_ids, dst_ids, sh0, dh0, nh):
    """Block ids one by one: a run table of one-block runs."""
    runs = torch.stack([src_ids.int(), dst_ids.int(), torch.ones_like(src_ids, dtype=torch.int32)], dim=1)
    copy_head_block_runs(srcs, dsts, runs, 1, sh0, dh0, nh)


@pytest.mark.parametrize(
    "src_heads,dst_heads,sh0,dh0,nh,dtype",
    [
        (8, 4, 4, 0, 4, torch.float32),  # unpack: upper half of a staged block into a tp=2 rank
        (4, 8, 0, 4, 4, torch.float16),  # pack: a rank's heads into their place of a whole block
        (2, 2, 0, 0, 2, torch.float32),  # same layout: whole blocks
        (3, 5, 1, 2, 2, torch.float16),  # odd sizes (row not a power of two)
    ],
)
def test_copy_head_blocks_matches_reference(src_heads, dst_heads, sh0, dh0, nh, dtype, device):
    g = torch.Generator().manual_seed(src_heads * 10 + dst_heads)
    src = torch.randn(2, 9, src_heads, 4, 12, generator=g).to(dtype).to(device)
    dst = torch.randn(2, 7, dst_heads, 4, 12, generator=g).to(dtype).to(device)
    src_ids = torch.tensor([8, 0, 3, 4], device=device)
    dst_ids = torch.tensor([1, 6, 2, 0], dtype=torch.int32, device=device)
    expected = dst.clone()
    copy_head_blocks_reference(src, expected, src_ids, dst_ids, sh0, dh0, nh)
    _copy_by_ids([src], [dst], src_ids, dst_ids, sh0, dh0, nh)
    assert torch.equal(dst, expected)


def test_copy_head_blocks_refuses_bad_arguments(device):
    src = torch.zeros(2, 3, 4, 2, 8, device=device)
    dst = torch.zeros(2, 3, 2, 2, 8, device=device)
    ids = torch.tensor([0, 1], device=device)
    with pytest.raises(ValueError, match="out of range"):
        _copy_by_ids([src], [dst], ids, ids, 0, 1, 2)
    with pytest.raises(ValueError, match="must be contiguous"):
        _copy_by_ids([src[:, :, ::2]], [dst], ids, ids, 0, 0, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_launch_over_layers_equals_the_per_layer_copies(dtype, device):
    """Separately allocated layers (as a KV pool's) in one launch = the per-layer reference."""
    g = torch.Generator().manual_seed(11)
    srcs = [torch.randn(2, 9, 4, 4, 8, generator=g).to(dtype).to(device) for _ in range(3)]
    dsts = [torch.randn(2, 6, 2, 4, 8, generator=g).to(dtype).to(device) for _ in range(3)]
    src_ids = torch.tensor([5, 0, 8], device=device)
    dst_ids = torch.tensor([2, 3, 0], device=device)
    expected = [d.clone() for d in dsts]
    for s, e in zip(srcs, expected, strict=True):
        copy_head_blocks_reference(s, e, src_ids, dst_ids, 2, 0, 2)
    _copy_by_ids(srcs, dsts, src_ids, dst_ids, 2, 0, 2)
    assert all(torch.equal(d, e) for d, e in zip(dsts, expected, strict=True))
    with pytest.raises(ValueError, match="first one's"):
        _copy_by_ids([srcs[0], srcs[1][:, :5]], dsts[:2], src_ids, dst_ids, 2, 0, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_copy_head_block_runs_equals_the_block_by_block_copy(dtype, device):
    """Runs of different lengths (longer than a program's rows, and of one block) in one launch."""
    from splitserve.kernels.pack import copy_head_block_runs

    g = torch.Generator().manual_seed(3)
    srcs = [torch.randn(2, 20, 4, 4, 8, generator=g).to(dtype).to(device) for _ in range(2)]
    dsts = [torch.randn(2, 16, 4, 4, 8, generator=g).to(dtype).to(device) for _ in range(2)]
    runs = [(2, 0, 7), (15, 9, 1), (10, 12, 3)]  # (src_block, dst_block, num_blocks)
    src_ids = torch.tensor([s + j for s, _, n in runs for j in range(n)], device=device)
    dst_ids = torch.tensor([d + j for _, d, n in runs for j in range(n)], device=device)
    expected = [d.clone() for d in dsts]
    for s, e in zip(srcs, expected, strict=True):
        copy_head_blocks_reference(s, e, src_ids, dst_ids, 1, 0, 3)
    table = torch.tensor(runs, dtype=torch.int32, device=device)
    copy_head_block_runs(srcs, dsts, table, 7, 1, 0, 3)
    assert all(torch.equal(d, e) for d, e in zip(dsts, expected, strict=True))
    with pytest.raises(ValueError, match="int32"):
        copy_head_block_runs(srcs, dsts, table.long(), 7, 1, 0, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_run_as_scalars_equals_the_table_form(dtype, device):
    """One run passed as a tuple (kernel scalars, no device table) writes what the table form does,
    and nothing outside the run."""
    from splitserve.kernels.pack import copy_head_block_runs

    g = torch.Generator().manual_seed(5)
    srcs = [torch.randn(2, 20, 4, 4, 8, generator=g).to(dtype).to(device) for _ in range(3)]
    dsts = [torch.randn(2, 16, 2, 4, 8, generator=g).to(dtype).to(device) for _ in range(3)]
    by_table = [d.clone() for d in dsts]
    copy_head_block_runs(srcs, by_table, torch.tensor([[3, 5, 9]], dtype=torch.int32, device=device), 9, 2, 0, 2)
    before = [d.clone() for d in dsts]
    copy_head_block_runs(srcs, dsts, (3, 5, 9), 9, 2, 0, 2)
    assert all(torch.equal(d, e) for d, e in zip(dsts, by_table, strict=True))
    assert not torch.equal(dsts[0], before[0])
    assert all(torch.equal(d[:, :5], b[:, :5]) and torch.equal(d[:, 14:], b[:, 14:]) for d, b in zip(dsts, before, strict=True))
    with pytest.raises(ValueError, match="one run"):
        copy_head_block_runs(srcs, dsts, (3, 5), 9, 2, 0, 2)


def test_repeated_launches_on_one_pool_pair_stay_exact(device):
    """The second and later launches on one (source, destination) pool pair take the cached launch
    state (and on CUDA the cached compiled kernel): each still copies exactly its own runs."""
    from splitserve.kernels.pack import copy_head_block_runs

    g = torch.Generator().manual_seed(9)
    srcs = [torch.randn(2, 24, 4, 4, 8, generator=g).to(device) for _ in range(2)]
    dsts = [torch.zeros(2, 24, 4, 4, 8, device=device) for _ in range(2)]
    expected = [d.clone() for d in dsts]
    for run in [(0, 1, 5), (7, 12, 2), (20, 0, 1), (3, 16, 8)]:
        copy_head_block_runs(srcs, dsts, run, run[2], 0, 0, 4)
        ids = torch.arange(run[2], device=device)
        for s, e in zip(srcs, expected, strict=True):
            copy_head_blocks_reference(s, e, ids + run[0], ids + run[1], 0, 0, 4)
        assert all(torch.equal(d, e) for d, e in zip(dsts, expected, strict=True)), run
