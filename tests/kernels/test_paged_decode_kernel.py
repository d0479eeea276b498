"""Triton paged decode attention against its torch reference (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import random_paged_case, tolerance  # noqa: E402

from splitserve.kernels.paged_decode import (  # noqa: E402
    DecodeWorkspace,
    paged_decode_attention,
    paged_decode_reference,
    plan_decode,
)

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])

# (block_size, head_dim, num_kv_heads, group): the Llama-3.2-1B-like base case,
# then one dimension varied at a time.
SHAPES = [
    (16, 64, 2, 4),
    (16, 64, 2, 1),
    (16, 64, 1, 2),
    (16, 32, 2, 4),
    (16, 128, 1, 4),
    (8, 64, 2, 2),
    (32, 64, 1, 4),
    (16, 80, 1, 3),  # not powers of two: padded head dim, 3 q heads per kv head
]


def _ctx_lens(block_size: int) -> list[int]:
    return [1, block_size, 2 * block_size, 3 * block_size + 5, 37]


def _run(shape, dtype, device, *, partition_size=None, block_n=None, index_dtype=torch.int32, seed=0):
    block_size, head_dim, num_kv_heads, group = shape
    ctx_lens = _ctx_lens(block_size)
    case = random_paged_case(
        ctx_lens, num_kv_heads, head_dim, block_size, dtype, device, seed=seed, index_dtype=index_dtype
    )
    q = torch.randn(
        len(ctx_lens), num_kv_heads * group, head_dim, generator=torch.Generator().manual_seed(seed)
    )
    q = q.to(dtype).to(device)
    plan = None
    if partition_size is not None:
        plan = plan_decode(
            len(ctx_lens),
            num_kv_heads,
            case.block_tables.shape[1],
            block_size,
            device,
            partition_size=partition_size,
            block_n=block_n,
        )
    scale = head_dim**-0.5
    out = paged_decode_attention(q, case.kv, case.block_tables, case.ctx_lens, scale, plan=plan)
    expected = paged_decode_reference(q, case.kv, case.block_tables, case.ctx_lens, scale)
    tol = tolerance(dtype)
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    return plan


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "bs{}-d{}-hkv{}-g{}".format(*s))
def test_split_partitions_match_reference(shape, dtype, device):
    # 16-token steps, 32-token partitions: several partitions per sequence, merged by stage 2.
    plan = _run(shape, dtype, device, partition_size=32, block_n=16, index_dtype=torch.int64)
    assert plan.num_partitions > 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_default_plan_matches_reference(dtype, device):
    _run((16, 64, 2, 4), dtype, device, seed=1)


def test_single_partition_path(device):
    plan = _run((16, 64, 2, 2), torch.float32, device, partition_size=128, block_n=32, seed=2)
    assert plan.num_partitions == 1


def test_empty_context_gives_zeros_and_reused_workspace(device):
    case = random_paged_case([0, 40, 0, 17], 2, 32, 16, torch.float32, device, seed=3)
    q = torch.randn(4, 4, 32, device=device)
    plan = plan_decode(4, 2, case.block_tables.shape[1], 16, device, partition_size=32, block_n=16)
    workspace = DecodeWorkspace.allocate(4, 4, 32, plan, device)
    out = torch.full_like(q, float("nan"))
    for _ in range(2):  # stale partials from the first call must not leak into the second
        paged_decode_attention(
            q, case.kv, case.block_tables, case.ctx_lens, 0.5, out=out, plan=plan, workspace=workspace
        )
        torch.testing.assert_close(
            out, paged_decode_reference(q, case.kv, case.block_tables, case.ctx_lens, 0.5)
        )
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))


def test_plan_depends_on_shapes_only():
    cpu = torch.device("cpu")
    plan = plan_decode(1, 8, 512, 16, cpu)
    assert plan.partition_size % plan.block_n == 0
    assert plan.num_partitions * plan.partition_size >= 512 * 16
    assert plan == plan_decode(1, 8, 512, 16, cpu)
    # A big batch needs fewer partitions per sequence than batch 1 ...
    assert plan_decode(64, 8, 512, 16, cpu).num_partitions <= plan.num_partitions
    # ... short contexts of a big batch are not split, long ones still are (ragged batches balance).
    assert plan_decode(64, 8, 48, 16, cpu).num_partitions == 1
    assert plan_decode(64, 8, 48, 16, cpu).block_n == 128  # unsplit: wider steps (4 warps)
    assert plan_decode(1, 8, 512, 16, cpu).block_n == 64
    assert plan_decode(512, 8, 2048, 16, cpu).num_partitions > 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_follows_new_contexts(device):
    case = random_paged_case([40, 100, 7], 2, 64, 16, torch.bfloat16, device, seed=4)
    q = torch.randn(3, 8, 64, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    tables, lens = case.block_tables.clone(), case.ctx_lens.clone()
    run = lambda: paged_decode_attention(q, case.kv, tables, lens, 0.125, out=out)  # noqa: E731
    run()  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    lens.copy_(torch.tensor([1, 16, 50], device=device, dtype=lens.dtype))
    tables.copy_(tables.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    expected = paged_decode_reference(q, case.kv, tables, lens, 0.125)
    torch.testing.assert_close(
        out.float(), expected.float(), atol=tolerance(q.dtype), rtol=tolerance(q.dtype)
    )
