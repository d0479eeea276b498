"""Layer-wise streaming: the destination pulls each layer once the source's board shows it
written, verifies it against the board's unit checksums, and ends with exactly the bytes a
non-streamed pull moves — in process (exact state at every step) and between real processes
(the source writes layers while the destination is already pulling), same layout and reshard."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp

import pytest
import torch
from kvtransfer_helpers import SENTINEL, handoff_case, run_processes, scatter
from streaming_helpers import LayerwiseSource, destination_process, source_process, stream_into_destination

from splitserve.engine.transfer.plan import layer_slice
from splitserve.engine.transfer.progress import BoardShape, ProgressBoard, RowView, request_tag
from splitserve.engine.transfer.streaming import UnitChecksumError, streamed_pull
from splitserve.engine.transfer.transport import TransferTimeout

HAS_NIXL = importlib.util.find_spec("nixl_cu13") is not None
RESHARD = dict(src=dict(tp=2, pp=1, kv_heads=4), dst=dict(tp=1, pp=2, kv_heads=4), num_blocks=5, pool=9, seed=3,
               first_block=0)
SAME = dict(src=dict(tp=1, pp=1, kv_heads=2), dst=dict(tp=1, pp=1, kv_heads=2), num_blocks=4, pool=7, seed=5,
            first_block=0)


def test_board_slots_tags_and_ready_prefix():
    board = ProgressBoard(BoardShape(num_slots=2, num_layers=3, num_heads=2))
    a, b = board.open("a"), board.open("b")
    assert (a, b) == (0, 1) and board.open("a") == a
    with pytest.raises(RuntimeError, match="all 2 progress slots"):
        board.open("c")
    kv = torch.randn(2, 4, 2, 2, 3)
    board.mark(a, 0, kv, [1, 2], num_tokens=4)
    board.mark(a, 2, kv, [1, 2], num_tokens=4)  # layer 1 not yet: only the prefix counts
    row = RowView.parse(board.tensor[a].tolist(), board.shape)
    assert row.num_ready_layers(request_tag("a"), 4) == 1
    assert row.num_ready_layers(request_tag("b"), 4) == 0  # someone else's slot
    assert row.num_ready_layers(request_tag("a"), 5) == 0  # not all tokens written yet
    board.close("a")
    assert board.tensor[a].abs().sum() == 0 and board.open("c") == a


def test_layer_slice_keeps_local_indices_in_step():
    _, _, _, _, _, plan = handoff_case(RESHARD)
    op = plan.ops[0]
    cut = layer_slice(op, 1, op.num_layers)
    assert (cut.layer_start, cut.num_layers) == (op.layer_start + 1, op.num_layers - 1)
    assert (cut.src_layer_start, cut.dst_layer_start) == (op.src_layer_start + 1, op.dst_layer_start + 1)
    with pytest.raises(ValueError, match="out of range"):
        layer_slice(op, 0, op.num_layers + 1)


@pytest.mark.parametrize("case", [SAME, RESHARD], ids=["same", "reshard"])
def test_inproc_stream_takes_ready_layers_only_then_completes_exactly(case):
    src = LayerwiseSource(case, "inproc")
    _, dst_lay, logical, _, dst_tables, plan = handoff_case(case)
    kv = scatter(torch.full_like(logical, SENTINEL), dst_lay, dst_tables, case["pool"])
    from splitserve.engine.transfer.inproc import InProcTransport

    t = InProcTransport()
    src.write_layer(0)
    with pytest.raises(TransferTimeout, match=r"layers from \[1"):
        streamed_pull(t, plan, 0, src.remote, kv[0], src.stream_spec(), timeout_s=0.05)
    # Layer 0 arrived, layer 1 did not: exact state after a partial stream.
    assert torch.equal(kv[0][0][:, dst_tables[0][0], : logical.shape[3] // dst_lay.tp],
                       logical[0, :, 0, : logical.shape[3] // dst_lay.tp])
    dst_layer1 = dst_lay.local_layer(1) if dst_lay.stage_of(1) == 0 else None
    if dst_layer1 is not None:
        assert (kv[0][dst_layer1] == SENTINEL).all()
    for layer in range(1, src.lay.num_layers):
        src.write_layer(layer)
    moved = 0
    for rank in range(dst_lay.world_size):
        moved += streamed_pull(t, plan, rank, src.remote, kv[rank], src.stream_spec(), timeout_s=5).num_bytes
    assert moved == plan.bytes_total
    from kvtransfer_helpers import check_destination

    for rank in range(dst_lay.world_size):
        check_destination(case, rank, kv[rank])
    src.close()


def test_a_layer_that_arrives_wrong_is_caught_by_its_unit_checksum():
    src = LayerwiseSource(RESHARD, "inproc")
    for layer in range(src.lay.num_layers):
        src.write_layer(layer, corrupt=layer == 1)
    with pytest.raises(UnitChecksumError, match="layer 1 heads from source rank"):
        stream_into_destination(RESHARD, "inproc", src.remote, src.stream_spec(), timeout_s=5)
    src.close()


def _stream_between_processes(case, kind):
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    run_processes([(source_process, case, kind, 0.05, a), (destination_process, case, kind, b)])


def test_shm_stream_reshard_between_processes_while_the_source_is_still_writing():
    _stream_between_processes(RESHARD, "shm")


@pytest.mark.slow
@pytest.mark.skipif(not HAS_NIXL, reason="NIXL (nixl-cu13) is not installed")
@pytest.mark.parametrize("case", [SAME, RESHARD], ids=["same", "reshard"])
def test_nixl_stream_between_processes_while_the_source_is_still_writing(case):
    _stream_between_processes(case, "nixl")


def test_shm_refuses_metadata_that_maps_past_the_shared_region():
    import json

    from splitserve.engine.transfer.shm_transport import ShmTransport
    from splitserve.engine.transfer.transport import TransferError

    kv = [torch.zeros(2, 3, 1, 2, 4)]
    with ShmTransport() as src, ShmTransport() as dst:
        meta = src.expose(kv)
        info = json.loads(meta[len(b"SSHM1"):])
        info["layers"][0]["size"] *= 1000
        with pytest.raises(TransferError, match="cannot map the peer's KV pool"):
            dst.open(b"SSHM1" + json.dumps(info).encode())
        mapped = dst.open(meta)[0][0]  # the real metadata maps the same memory, at another address
        kv[0].fill_(3.5)
        assert mapped.data_ptr() != kv[0].data_ptr() and torch.equal(mapped, kv[0])
