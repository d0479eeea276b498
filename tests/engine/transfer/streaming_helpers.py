"""Helpers for the layer-wise streaming tests: a source that "prefills" layer by layer (copies a
logical KV into its pools one global layer at a time, publishing each on its ranks' boards), and
the bodies of the spawned source / destination processes."""

from __future__ import annotations

import time

import torch
from kvtransfer_helpers import SENTINEL, _report, check_destination, handoff_case, scatter

from splitserve.engine.transfer.progress import request_tag

REQUEST = "req-stream"


def make_transport(kind: str, name: str):
    if kind == "nixl":
        from splitserve.engine.transfer.nixl_transport import NixlTransport

        return NixlTransport(name, num_board_slots=4)
    if kind == "shm":
        from splitserve.engine.transfer.shm_transport import ShmTransport

        return ShmTransport(num_board_slots=4)
    from splitserve.engine.transfer.inproc import InProcTransport

    return InProcTransport(num_board_slots=4)


class LayerwiseSource:
    """Every source rank of `case`: SENTINEL pools, a board each, exposed through `kind`."""

    def __init__(self, case: dict, kind: str):
        self.case = case
        self.lay, _, self.logical, self.tables, _, self.plan = handoff_case(case)
        empty = torch.full_like(self.logical, SENTINEL)
        self.kv = scatter(empty, self.lay, self.tables, case["pool"])
        self.boards, self.transports, self.remote = {}, {}, {}
        for rank in self.kv:
            t = make_transport(kind, f"stream-src-{rank}-{case['seed']}")
            self.remote[rank] = t.expose(self.kv[rank])
            self.boards[rank] = t.board
            self.transports[rank] = t
        self.slot = 0
        for board in self.boards.values():
            board.open("someone-else")  # the request gets slot 1 on every rank
            self.slot = board.open(REQUEST)

    @property
    def num_tokens(self) -> int:
        return self.case["num_blocks"] * self.lay.block_size

    def write_layer(self, layer: int, corrupt: bool = False) -> None:
        """Global `layer` computed: write it on every rank holding it, then publish it."""
        for rank, tensors in self.kv.items():
            start, end = self.lay.layer_ranges[self.lay.pp_rank(rank)]
            if not start <= layer < end:
                continue
            h0, h1 = self.lay.heads_of(self.lay.tp_rank(rank))
            for j, block in enumerate(self.tables[rank]):
                tensors[layer - start][:, block] = self.logical[layer, :, j, h0:h1]
            self.boards[rank].mark(self.slot, layer - start, tensors[layer - start], self.tables[rank], self.num_tokens)
            if corrupt:
                tensors[layer - start].view(torch.uint8)[0, self.tables[rank][0], 0, 0, 0] ^= 0x01

    def stream_spec(self):
        from splitserve.engine.transfer.streaming import StreamSpec

        return StreamSpec(self.slot, request_tag(REQUEST), self.num_tokens)

    def close(self) -> None:
        for t in self.transports.values():
            t.close()


def stream_into_destination(case: dict, kind: str, remote, spec, timeout_s: float = 30.0) -> int:
    """Every destination rank streams its ops; checks its pool exactly. Returns bytes moved."""
    from splitserve.engine.transfer.streaming import streamed_pull

    _, dst_lay, logical, _, dst_tables, plan = handoff_case(case)
    kv = scatter(torch.full_like(logical, SENTINEL), dst_lay, dst_tables, case["pool"])
    moved = 0
    for rank in range(dst_lay.world_size):
        t = make_transport(kind, f"stream-dst-{rank}-{case['seed']}")
        try:
            moved += streamed_pull(t, plan, rank, remote, kv[rank], spec, timeout_s).num_bytes
        finally:
            t.close()
        check_destination(case, rank, kv[rank])
    return moved


def source_process(case: dict, kind: str, layer_s: float, conn, results) -> None:
    """Publishes endpoints + boards first, then writes one layer every `layer_s` seconds."""
    def body():
        src = LayerwiseSource(case, kind)
        conn.send((src.remote, src.stream_spec()))
        assert conn.recv() == "started"
        for layer in range(src.lay.num_layers):
            time.sleep(layer_s)
            src.write_layer(layer)
        conn.send(time.monotonic())
        assert conn.poll(60), "destination never finished"
        assert conn.recv() == "done"
        src.close()
    _report(results, "source", body)


def destination_process(case: dict, kind: str, conn, results) -> None:
    """Starts streaming before the source has written anything; ends after its last layer."""
    def body():
        remote, spec = conn.recv()
        conn.send("started")
        try:
            stream_into_destination(case, kind, remote, spec)
            done_at = time.monotonic()
            prefill_end = conn.recv()
            assert done_at >= prefill_end  # nothing finished before the last layer existed
        finally:
            conn.send("done")
    _report(results, "destination", body)
