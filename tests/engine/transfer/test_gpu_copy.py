"""GPU plan-op copies (engine/transfer/gpu_copy.py) give the plan's reference result, for whole
blocks, head ranges (reshards) and scattered ids (the graph-replayed copies: test_graph_copy_gpu.py).
CUDA only (the H200 runs it; on CPU the transports use engine/transfer/local_copy.py)."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.transfer import gpu_copy
from splitserve.engine.transfer.plan import BlockRun, TransferOp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _op(runs, src_heads=(0, 4), dst_head=0, layers=(1, 0, 3)) -> TransferOp:
    layer_start, dst_layer_start, num_layers = layers
    return TransferOp(src_rank=0, dst_rank=0, layer_start=layer_start, num_layers=num_layers,
                      src_layer_start=layer_start, dst_layer_start=dst_layer_start,
                      src_head_start=src_heads[0], dst_head_start=dst_head, num_heads=src_heads[1],
                      block_runs=tuple(BlockRun(*r) for r in runs))


def _expected(op, src, dst):
    out = [d.clone() for d in dst]
    sh = slice(op.src_head_start, op.src_head_start + op.num_heads)
    dh = slice(op.dst_head_start, op.dst_head_start + op.num_heads)
    for i in range(op.num_layers):
        s, d = src[op.src_layer_start + i], out[op.dst_layer_start + i]
        for r in op.block_runs:
            d[:, r.dst_block : r.dst_block + r.num_blocks, dh] = s[:, r.src_block : r.src_block + r.num_blocks, sh]
    return out


@pytest.mark.parametrize("case", ["whole", "heads", "scattered"])
def test_copy_op_cuda_matches_the_reference(case):
    g = torch.Generator().manual_seed(0)
    dst_heads = 4 if case == "whole" else 2
    src = [torch.randn(2, 40, 4, 16, 64, generator=g).to(torch.bfloat16).cuda() for _ in range(4)]
    dst = [torch.randn(2, 30, dst_heads, 16, 64, generator=g).to(torch.bfloat16).cuda() for _ in range(3)]
    if case == "whole":
        op = _op([(3, 0, 12), (20, 15, 5)])
    elif case == "heads":
        op = _op([(3, 0, 12), (20, 15, 5)], src_heads=(2, 2))
    else:
        op = _op([(s, d, 1) for s, d in zip(range(39, 9, -2), range(0, 30, 2), strict=True)], src_heads=(1, 2))
    expected = _expected(op, src, dst)
    gpu_copy.copy_op_cuda(op, src, dst)
    torch.cuda.synchronize()
    assert all(torch.equal(d, e) for d, e in zip(dst, expected, strict=True))


def test_graph_copies_keyed_by_a_remembered_pool_pair_follow_a_replaced_pool():
    """With the transport's remembered pool-pair key (graph_copy.PoolPairKeys): a pool list whose
    tensor was replaced gets a new key, so the copy lands in the new tensor, not the captured one."""
    from splitserve.engine.transfer import graph_copy

    g = torch.Generator().manual_seed(2)
    src = [torch.randn(2, 40, 4, 16, 64, generator=g).to(torch.bfloat16).cuda() for _ in range(4)]
    dst = [torch.zeros(2, 30, 4, 16, 64, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    keys = graph_copy.PoolPairKeys()
    op = _op([(3, 0, 12)], src_heads=(0, 4))
    held = []
    assert graph_copy.copy_op_graph(op, src, dst, held, keys.key(src, dst))
    torch.cuda.synchronize()
    graph_copy.release(held)
    old = dst[1]
    dst[1] = torch.zeros_like(old)
    expected = _expected(op, src, dst)
    assert graph_copy.copy_op_graph(op, src, dst, held, keys.key(src, dst))
    torch.cuda.synchronize()
    graph_copy.release(held)
    assert all(torch.equal(d, e) for d, e in zip(dst, expected, strict=True))


def test_the_cached_current_stream_follows_stream_contexts():
    """gpu_copy.current_stream caches Stream objects by the raw current-stream lookup: inside a
    stream context it is that stream, outside the default one again."""
    index = torch.cuda.current_device()
    side = torch.cuda.Stream()
    assert gpu_copy.current_stream(index) == torch.cuda.current_stream(index)
    with torch.cuda.stream(side):
        assert gpu_copy.current_stream(index) == side
    assert gpu_copy.current_stream(index) == torch.cuda.default_stream(index)
