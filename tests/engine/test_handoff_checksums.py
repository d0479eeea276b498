"""The block checksums' fast torch forms (engine/handoff_checksums.py) equal their definition,
reduced word by word in int64: per block, Σ over units u = (layer, kv head) of m_u · (s1, s2),
s1 = Σ w_i, s2 = Σ i·w_i over the unit's 16-bit words (its K slab then its V slab), mod 2^31 − 1."""

import pytest
import torch

from splitserve.engine import handoff_checksums
from splitserve.engine.handoff_checksums import PRIME, _half_sums, partial_block_checksums
from splitserve.engine.transfer.layout import KVLayout


def _definition(kv_tensors, layout: KVLayout, rank: int, block_ids) -> torch.Tensor:
    tp_rank = layout.tp_rank(rank)
    h0, h1 = layout.heads_of(tp_rank)
    layer0 = layout.layer_ranges[layout.pp_rank(rank)][0]
    out = torch.zeros(len(block_ids), 2, dtype=torch.int64)
    for li, t in enumerate(kv_tensors):
        for row, b in enumerate(block_ids):
            for h in range(h0, h1):
                if not layout.is_primary(tp_rank, h):
                    continue
                words = torch.cat([t[0, b, h - h0].reshape(-1), t[1, b, h - h0].reshape(-1)])
                words = words.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
                i = torch.arange(1, words.numel() + 1, dtype=torch.int64)
                mult = (layer0 + li) * layout.num_kv_heads + h + 1
                out[row, 0] += mult * (int(words.sum()) % PRIME)
                out[row, 1] += mult * (int((words * i).sum()) % PRIME)
        out %= PRIME
    return out


@pytest.mark.parametrize(
    ("dtype", "block_size", "head_dim", "tp", "kv_heads"),
    [
        (torch.float32, 16, 64, 1, 2),  # 2048 words per half: the float32 row/column form
        (torch.bfloat16, 8, 16, 2, 4),  # 128 words, a TP rank's half of the heads
        (torch.float16, 4, 40, 1, 2),  # 160 words (not a multiple of 64): the float64 form
        (torch.float32, 4, 8, 4, 2),  # GQA heads replicated over TP 4: only primaries count
    ],
)
@pytest.mark.parametrize(
    "blocks",
    [[2, 3, 4, 5], [6, 1, 6, 0], [*range(20, 30), *range(2, 12)]],
    ids=["run", "gather", "two runs"],
)
@pytest.mark.parametrize("slice_words", [None, 256], ids=["", "small slices"])
@pytest.mark.parametrize("integer", [True, False], ids=["int32 sums", "float32 sums (the CUDA form)"])
def test_block_checksums_equal_their_definition(
    dtype, block_size, head_dim, tp, kv_heads, blocks, slice_words, integer, monkeypatch
):
    monkeypatch.setattr(handoff_checksums, "CPU_INTEGER_FORM", integer)
    if slice_words:  # every piece cut into slices of a few units
        monkeypatch.setattr(handoff_checksums, "_SLICE_WORDS", slice_words)
    layout = KVLayout(dtype=str(dtype).removeprefix("torch."), block_size=block_size, tp=tp, pp=1, num_layers=3,
                      num_kv_heads=kv_heads, head_dim=head_dim)
    g = torch.Generator().manual_seed(3)
    for rank in range(tp):
        local = layout.num_local_heads
        kv = [(torch.randn(2, 32, local, block_size, head_dim, generator=g) * 50).to(dtype) for _ in range(3)]
        got = partial_block_checksums(kv, layout, rank, blocks)
        assert torch.equal(got, _definition(kv, layout, rank, blocks)), rank


def test_a_flipped_high_bit_changes_only_its_block():
    layout = KVLayout(dtype="float32", block_size=16, tp=1, pp=1, num_layers=2, num_kv_heads=2, head_dim=64)
    kv = [torch.randn(2, 4, 2, 16, 64, generator=torch.Generator().manual_seed(1)) for _ in range(2)]
    before = partial_block_checksums(kv, layout, 0, [0, 1, 2, 3])
    kv[1].view(torch.int16)[1, 2, 1, 15, 63] ^= -32768  # the top bit of a V word of block 2
    after = partial_block_checksums(kv, layout, 0, [0, 1, 2, 3])
    assert (after != before).any(-1).tolist() == [False, False, True, False]


@pytest.mark.parametrize("m", [64, 1024, 16384])
def test_half_sums_exact_at_the_largest_words(m):
    """All words 0xFFFF (and a random tail) at the widest row count the integer form takes
    (m / 64 = 256 rows): its int32 row and column sums must not overflow."""
    words = torch.full((3, m), -1, dtype=torch.int16)
    words[2] = torch.randint(-(1 << 15), 1 << 15, (m,), generator=torch.Generator().manual_seed(5), dtype=torch.int16)
    wide = words.to(torch.int64) & 0xFFFF
    i = torch.arange(1, m + 1, dtype=torch.int64)
    want = torch.stack([wide.sum(-1), (wide * i).sum(-1)], dim=1)
    assert torch.equal(_half_sums(iter([words.view(torch.uint16)]), 3, m, words.device), want)


def test_no_kv_tensors_sum_to_zero():
    """A rank without KV tensors (the simulated engine) contributes nothing."""
    layout = KVLayout(dtype="float32", block_size=4, tp=1, pp=1, num_layers=2, num_kv_heads=2, head_dim=8)
    assert torch.equal(partial_block_checksums([], layout, 0, [0, 1]), torch.zeros(2, 2, dtype=torch.int64))


@pytest.mark.parametrize("group_units", [1, 1 << 12], ids=["a layer a group", "layers grouped"])
def test_layer_subsets_add_up_to_the_whole_on_every_pp_rank(group_units, monkeypatch):
    """Layers are summed in groups (`_GROUP_UNITS`); whatever the grouping, a pp rank's share uses
    its own layers' multipliers, and the shares of disjoint layer subsets (layer-wise streaming
    sums them as layers arrive, in any order) add up to the whole."""
    monkeypatch.setattr(handoff_checksums, "_GROUP_UNITS", group_units)
    layout = KVLayout(dtype="bfloat16", block_size=16, tp=1, pp=2, num_layers=6, num_kv_heads=2, head_dim=64)
    g = torch.Generator().manual_seed(11)
    blocks = [*range(3, 9), 1]
    for rank in range(2):  # rank 1 holds layers 3..5
        kv = [(torch.randn(2, 12, 2, 16, 64, generator=g) * 50).to(torch.bfloat16) for _ in range(3)]
        whole = partial_block_checksums(kv, layout, rank, blocks)
        assert torch.equal(whole, _definition(kv, layout, rank, blocks)), rank
        parts = partial_block_checksums(kv, layout, rank, blocks, [2, 0]) + partial_block_checksums(kv, layout, rank, blocks, [1])
        assert torch.equal(parts % PRIME, whole), rank
