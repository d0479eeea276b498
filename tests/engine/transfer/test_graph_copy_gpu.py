"""Handoff copy graphs on the GPU (engine/transfer/graph_copy.py): the run reaches the kernel as
arguments rewritten in the executable graph (graph_node.ScalarGraph), or, where that cannot be
done, through a pinned-to-device memcpy node; both exact run after run.
CUDA only (the H200 runs it)."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.transfer import graph_copy, graph_node
from splitserve.engine.transfer.plan import BlockRun, TransferOp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(params=["arguments", "memcpy_node"])
def kind(request, monkeypatch):
    """Each test once per graph kind, from an empty graph cache."""
    if request.param == "memcpy_node":
        monkeypatch.setattr(graph_node, "_DRIVER", [None])
    graph_copy.forget_pools()
    yield request.param
    graph_copy.forget_pools()


def _op(run, heads=(0, 4), layers=(0, 0, 2)) -> TransferOp:
    src_layer, dst_layer, num_layers = layers
    return TransferOp(src_rank=0, dst_rank=0, layer_start=src_layer, num_layers=num_layers,
                      src_layer_start=src_layer, dst_layer_start=dst_layer, src_head_start=heads[0],
                      dst_head_start=0, num_heads=heads[1], block_runs=(BlockRun(*run),))


def _pools(seed: int, dst_heads: int = 4):
    g = torch.Generator().manual_seed(seed)
    src = [torch.randn(2, 40, 4, 16, 64, generator=g).to(torch.bfloat16).cuda() for _ in range(3)]
    dst = [torch.zeros(2, 40, dst_heads, 16, 64, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    return src, dst


def _launched_kinds() -> set[str]:
    return {"arguments" if g.scalar is not None else "memcpy_node" for g in graph_copy._GRAPHS.values()}


def test_a_graph_dropped_from_the_cache_stays_alive_until_its_pull_has_synchronised(kind):
    """A pull keeps the graph it launched (in `held`) until it has synchronised and released,
    even when the graph cache is emptied meanwhile (a full cache, a lifecycle resume)."""
    import gc
    import weakref

    src, dst = _pools(7)
    held = []
    assert graph_copy.copy_op_graph(_op((1, 2, 6)), src, dst, held)
    ref = weakref.ref(held[0])
    graph_copy.forget_pools()
    gc.collect()
    assert ref() is not None
    torch.cuda.synchronize()
    graph_copy.release(held)
    gc.collect()
    assert ref() is None and not held
    assert all(torch.equal(d[:, 2:8], s[:, 1:7]) for s, d in zip(src[:2], dst[:2], strict=True))


def test_runs_in_one_bucket_and_across_buckets_are_exact(kind):
    """Lengths 5..8 share a bucket (one graph, arguments rewritten each time); each pull copies
    exactly its run's blocks and heads into the destination and nothing else."""
    src, dst = _pools(3, dst_heads=2)
    expected = [d.clone() for d in dst]
    for run, heads, layers in [((3, 0, 8), (2, 2), (1, 0, 2)), ((11, 9, 5), (2, 2), (1, 0, 2)),
                               ((30, 20, 7), (2, 2), (1, 0, 2)), ((0, 35, 1), (0, 2), (0, 1, 2)),
                               ((4, 14, 16), (1, 2), (0, 0, 3))]:
        op = _op(run, heads, layers)
        for i in range(op.num_layers):
            s, e = src[op.src_layer_start + i], expected[op.dst_layer_start + i]
            e[:, run[1] : run[1] + run[2]] = s[:, run[0] : run[0] + run[2], heads[0] : heads[0] + 2]
        held = []
        assert graph_copy.copy_op_graph(op, src, dst, held)
        torch.cuda.synchronize()
        graph_copy.release(held)
        assert all(torch.equal(d, e) for d, e in zip(dst, expected, strict=True)), run
    assert _launched_kinds() == {kind}


def test_an_argument_graph_is_launched_again_before_the_first_copy_has_run(kind):
    """An argument-rewriting graph is free again once launched: the executable graph's update does
    not touch the launch already queued, so back-to-back pulls of one shape both land, each with
    its own run (each pull still holds the graph object until it has synchronised). A memcpy-node
    graph stays with the pull that replayed it until released."""
    src, dst = _pools(4)
    first, second = [], []
    assert graph_copy.copy_op_graph(_op((0, 0, 4)), src, dst, first)
    again = graph_copy.copy_op_graph(_op((8, 8, 4)), src, dst, second)
    if kind == "arguments":
        assert again and len(first) == 1 and first[0] is second[0]
        torch.cuda.synchronize()
        graph_copy.release(first)
    else:
        assert not again and not second and len(first) == 1
        torch.cuda.synchronize()
        graph_copy.release(first)
        assert graph_copy.copy_op_graph(_op((8, 8, 4)), src, dst, second)
    torch.cuda.synchronize()
    graph_copy.release(second)
    for s, d in zip(src, dst[:2], strict=False):
        assert torch.equal(d[:, :4], s[:, :4]) and torch.equal(d[:, 8:12], s[:, 8:12]) and not d[:, 4:8].any()


def test_a_pull_through_cuda_ipc_names_its_stream_and_copies_on_it(kind):
    """The transport hands its stream to the graph (no lookup per pull); a side stream's copy is
    on that stream: done once that stream is synchronised."""
    src, dst = _pools(5)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    held = []
    with torch.cuda.stream(side):
        assert graph_copy.copy_op_graph(_op((2, 6, 9)), src, dst, held, stream=side)
    graph_node.synchronize(side)
    graph_copy.release(held)
    assert all(torch.equal(d[:, 6:15], s[:, 2:11]) for s, d in zip(src[:2], dst[:2], strict=True))


def test_a_capture_that_is_not_one_identifiable_kernel_is_refused():
    """Two kernels in the capture, or a sentinel in two arguments: Unsupported (the caller then
    captures a memcpy-node graph), never a graph whose arguments might be the wrong ones."""
    from splitserve.kernels.pack import NUM_WARPS, copy_grid, copy_head_block_runs

    if graph_node.driver() is None:
        pytest.skip("no CUDA driver library reachable from ctypes")
    src, dst = _pools(6)
    grid = copy_grid(1, 8, 2)
    copy_head_block_runs(src[:2], dst[:2], (111, 222, 0), 0, 0, 0, 4, grid_blocks=8)

    def two(s0, d0, n):
        for _ in range(2):
            copy_head_block_runs(src[:2], dst[:2], (s0, d0, n), 0, 0, 0, 4, grid_blocks=8)

    with pytest.raises(graph_node.Unsupported, match="2 nodes"):
        graph_node.ScalarGraph(two, (111, 222, 16), grid, NUM_WARPS)
    with pytest.raises(graph_node.Unsupported, match="found in 2"):
        graph_node.ScalarGraph(
            lambda s0, d0, n: copy_head_block_runs(src[:2], dst[:2], (s0, s0, n), 0, 0, 0, 4, grid_blocks=8),
            (111, 222, 16), grid, NUM_WARPS)
    torch.cuda.synchronize()
    assert not any(d.any() for d in dst)
