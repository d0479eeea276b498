"""CUDA-IPC endpoint metadata is plain JSON with allow-listed names, never a pickle:
a peer's bytes can fail to map, never run code. (The mapping itself needs a GPU:
benchmarks/ttft_disagg.py and multi_gpu.py exercise it on the H200.)"""

import json

import pytest
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from splitserve.engine.transfer.cuda_ipc import CudaIpcTransport, decode_ipc_handle, encode_ipc_handle
from splitserve.engine.transfer.transport import TransferError

ARGS = (torch.Tensor, torch.Size([2, 5, 8, 16, 64]), (40960, 8192, 1024, 64, 1), 0, torch.TypedStorage,
        torch.bfloat16, 0, b"\x01\x02" * 32, 163840, 512, False, b"ref-counter", 8, b"\x07" * 64, True)


def test_handle_round_trips_through_json():
    wire = json.dumps(encode_ipc_handle(rebuild_cuda_tensor, ARGS))
    assert decode_ipc_handle(json.loads(wire)) == ARGS
    no_event = ARGS[:13] + (None, False)
    assert decode_ipc_handle(json.loads(json.dumps(encode_ipc_handle(rebuild_cuda_tensor, no_event)))) == no_event


@pytest.mark.parametrize(
    "tamper",
    [
        lambda h: h.update(dtype="os.system"),
        lambda h: h.update(storage_cls="Popen"),
        lambda h: h.update(size=["1; rm -rf /"]),
        lambda h: h.update(extra=1),
        lambda h: h.pop("handle"),
    ],
)
def test_tampered_handles_are_refused(tamper):
    h = encode_ipc_handle(rebuild_cuda_tensor, ARGS)
    tamper(h)
    with pytest.raises(ValueError, match="malformed"):
        decode_ipc_handle(h)


def test_garbage_metadata_is_a_transfer_error_not_code():
    transport = CudaIpcTransport()
    for metadata in (b"\x80\x04\x95 not json", json.dumps([{"dtype": "float32"}]).encode()):
        with pytest.raises(TransferError, match="CUDA IPC"):
            transport.open(metadata)


def test_only_cuda_reductions_are_encoded():
    with pytest.raises(ValueError, match="IPC reduction"):
        encode_ipc_handle(print, ARGS)


def test_peer_pools_beyond_the_limit_are_unmapped_oldest_first(monkeypatch):
    """A peer that suspends and resumes publishes new handles; its old pool stays allocated on the
    peer while mapped here, so only the newest `MAX_MAPPED` pools stay (the mapping itself is
    stubbed: this host may have no GPU)."""
    from splitserve.engine.transfer import cuda_ipc

    monkeypatch.setattr(cuda_ipc, "MAX_MAPPED", 2)
    monkeypatch.setattr(cuda_ipc, "decode_ipc_handle", lambda h: (h,))
    monkeypatch.setattr(cuda_ipc, "rebuild_cuda_tensor", lambda h: torch.full((1,), float(h)))
    transport = cuda_ipc.CudaIpcTransport(graphs=False)
    first = transport.open(b"[1]")
    assert transport.open(b"[1]") is first  # mapped once
    transport.open(b"[2]")
    transport.open(b"[3]")
    assert set(transport._mapped) == {b"[2]", b"[3]"}
    assert transport.open(b"[1]") is not first  # mapped again when asked again
