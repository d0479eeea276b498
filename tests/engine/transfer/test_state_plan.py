"""Recurrent-state reshard plans: for every (tp, pp) pair, moving the plan's byte regions
rebuilds exactly the destination layout's slices of the logical state — conv channels
split as [x heads | B groups | C groups] per rank — and nothing else is written."""

import itertools

import numpy as np
import pytest
import torch

from splitserve.engine.state_handoff import partial_state_checksum
from splitserve.engine.transfer.state_plan import StateLayout, build_state_plan, state_bytes, state_regions
from splitserve.engine.transfer.state_transport import copy_regions, pack, unpack

LAYERS, HEADS, P, GROUPS, N, K1 = 3, 8, 4, 4, 6, 3
SENTINEL = -3.5


def layout(tp, pp, ranges=None):
    ranges = ranges or {1: ((0, 3),), 2: ((0, 2), (2, 3))}[pp]
    return StateLayout(tp=tp, pp=pp, num_layers=LAYERS, layer_ranges=ranges, num_heads=HEADS, head_dim=P,
                       num_groups=GROUPS, state_size=N, conv_width=K1, conv_dtype="float32", ssm_dtype="float32")


def logical(seed=0):
    g = torch.Generator().manual_seed(seed)
    conv_dim = HEADS * P + 2 * GROUPS * N
    return torch.randn(LAYERS, conv_dim, K1, generator=g), torch.randn(LAYERS, HEADS, P, N, generator=g)


def scatter(lay, conv, ssm, slot, num_slots=3):
    """Per rank: the flat tensor list [conv_0, ssm_0, ...] with the logical state at `slot`."""
    out = {}
    for rank in range(lay.world_size):
        tp_rank, pp_rank = rank % lay.tp, rank // lay.tp
        channels = torch.as_tensor(lay.local_conv_channels(tp_rank))
        h0 = tp_rank * lay.heads_per_rank
        tensors = []
        for layer in range(*lay.layer_ranges[pp_rank]):
            c = torch.full((num_slots, lay.conv_local, K1), SENTINEL)
            s = torch.full((num_slots, lay.heads_per_rank, P, N), SENTINEL)
            c[slot] = conv[layer, channels]
            s[slot] = ssm[layer, h0:h0 + lay.heads_per_rank]
            tensors += [c, s]
        out[rank] = tensors
    return out


PAIRS = [((st, sp), (dt, dp)) for st, sp, dt, dp in itertools.product((1, 2, 4), (1, 2), (1, 2, 4), (1, 2))]


@pytest.mark.parametrize("src, dst", PAIRS, ids=[f"tp{a}pp{b}-to-tp{c}pp{d}" for (a, b), (c, d) in PAIRS])
def test_plan_moves_exactly_the_destination_slices(src, dst):
    src_lay, dst_lay = layout(*src), layout(*dst)
    conv, ssm = logical()
    source = scatter(src_lay, conv, ssm, slot=2)
    want = scatter(dst_lay, conv, ssm, slot=0)
    got = scatter(dst_lay, torch.full_like(conv, SENTINEL), torch.full_like(ssm, SENTINEL), slot=0)
    ops = build_state_plan(src_lay, dst_lay)
    moved = 0
    for dst_rank in range(dst_lay.world_size):
        for src_rank in range(src_lay.world_size):
            pair = [op for op in ops if op.src_rank == src_rank and op.dst_rank == dst_rank]
            regions = state_regions(pair, src_lay, dst_lay, src_slot=2, dst_slot=0)
            if src_rank % 2:  # odd sources go through pack/unpack (the torch_dist path)
                unpack(pack(regions, source[src_rank]), regions, got[dst_rank])
                moved += regions.bytes_total
            else:
                moved += copy_regions(regions, source[src_rank], got[dst_rank])
    for rank in want:
        for a, b in zip(got[rank], want[rank], strict=True):
            assert torch.equal(a, b)
    full = 4 * LAYERS * ((HEADS * P + 2 * GROUPS * N) * K1 + HEADS * P * N)
    assert moved == state_bytes(ops, src_lay) == full  # every byte once: no replicas, no overlaps


def test_three_conv_runs_when_tp_changes():
    ops = build_state_plan(layout(1, 1), layout(2, 1))
    assert [(r.kind, r.src_start, r.dst_start, r.length) for r in ops[1].runs] == [
        ("conv", 16, 0, 16),  # x channels of heads 4-7
        ("conv", 32 + 12, 16, 12),  # B of groups 2-3
        ("conv", 32 + 24 + 12, 16 + 12, 12),  # C of groups 2-3
        ("ssm", 4, 0, 4),
    ]


@pytest.mark.parametrize("src, dst", [((1, 1), (2, 2)), ((4, 1), (1, 2))])
def test_checksum_is_layout_independent_and_catches_one_bit(src, dst):
    conv, ssm = logical(seed=5)
    sums = []
    for lay, slot in ((layout(*src), 1), (layout(*dst), 2)):
        ranks = scatter(lay, conv, ssm, slot)
        sums.append(sum(partial_state_checksum(ranks[r], lay, r, slot) for r in ranks) % ((1 << 31) - 1))
    assert torch.equal(sums[0], sums[1])
    lay = layout(*dst)
    ranks = scatter(lay, conv, ssm, 2)
    ranks[lay.world_size - 1][-1].view(torch.uint8)[2, 0, 0, 0] ^= 1
    bad = sum(partial_state_checksum(ranks[r], lay, r, 2) for r in ranks) % ((1 << 31) - 1)
    assert not torch.equal(bad, sums[0])


def test_incompatible_layouts_are_refused():
    other = StateLayout(tp=1, pp=1, num_layers=LAYERS, layer_ranges=((0, 3),), num_heads=HEADS, head_dim=P,
                        num_groups=GROUPS, state_size=N, conv_width=K1, conv_dtype="float32", ssm_dtype="bfloat16")
    with pytest.raises(ValueError, match="ssm_dtype: src='float32' dst='bfloat16'"):
        build_state_plan(layout(1, 1), other)
    with pytest.raises(ValueError, match="cannot be split over tp=3"):
        layout(3, 1)
    assert np.array_equal(layout(2, 1).local_conv_channels(1)[:2], [16, 17])
