"""Prefill side of layer-wise streaming: publish a pinned handoff's layers on the progress board
of this rank's transport (engine/transfer/progress.py), and give slots back when pins go.

    after a step, every prefill rank, for each request that reached its handoff:
      slot = board.open(request)                 same slot on every rank: every rank opens and
      for each local layer: board.mark(...)      closes in the same order, from the same outputs
      rank 0 puts `slot` in the descriptor
    after every step: slots of requests no longer pinned (acked, aborted, expired) are closed

Served streaming (`LayerPublisher`): when the step that completes a prompt starts, each rank
opens the request's slot *before* the forward pass and rank 0 publishes a preview of the handoff
(`PrefillEvent.handoff_started`: blocks, layout, endpoints, slot — no first token, no checksums);
the router gives it to the decode worker's `Prefetch` (engine/prefetch.py), which pulls each
layer as soon as the forward pass has written it:

    step start ─▶ open slot, preview ─(router)─▶ decode: reserve blocks, poll the board
    layer 0 forward ─▶ ready[0] = prompt_len           pull layer 0
    layer 1 forward ─▶ ready[1] = prompt_len           pull layer 1 ...
    step end ─▶ first token, then `publish_layers` (all layers), descriptor ─▶ Decode: verify

Per-layer marks need the layer's KV writes finished when the mark is written: true on the CPU
(the forward is synchronous, the mark is written from the layer callback). On a GPU the callback
only queues: it records a CUDA event behind the layer's kernels (`DeviceLayerMarks`), and the
engine thread — which waits for the step's results next anyway (`ModelRunner.collect`) — waits
on the events in layer order and writes each mark as its layer finishes, so a decode worker
pulls layer i while layers i+1… still run. Everything stays on the engine thread: a slot is
never marked after `close_released` gave it back. The marks carry readiness only; a prefetch is
verified by the descriptor's block checksums on import.
"""

from __future__ import annotations

from collections.abc import Callable

from splitserve.engine.transfer.progress import ProgressBoard


def publish_layers(engine, board: ProgressBoard, handoff) -> int | None:
    """Open a slot for `handoff` (or keep the one `LayerPublisher` opened) and mark every local
    layer written. Readiness only: the served path verifies an import by the descriptor's block
    checksums, so per-(layer, head) unit checksums would be a second pass over the KV for nothing.

    Returns the slot, or None when the board is full (the handoff is then published without
    streaming and pulled all at once). Call on every rank of the prefill group."""
    try:
        slot = board.open(handoff.request_id)
    except RuntimeError:
        return None
    for layer in range(len(engine.kv_caches)):
        board.mark(slot, layer, None, (), handoff.num_tokens)
    return slot


def close_released(engine, board: ProgressBoard) -> None:
    """Give back the slots of requests whose pins are gone (ack, abort, lease expiry), or that
    ended without a handoff; a request still in the engine (its step in flight) keeps its slot."""
    for request_id in board.open_requests():
        if request_id not in engine.handoffs and not engine.has_request(request_id):
            board.close(request_id)


StartedCallback = Callable[[str, int, tuple[int, ...], int], None]
"""`on_started(request_id, slot, block_ids, num_tokens)`: a streamed handoff's forward pass begins."""


class LayerPublisher:
    """The model runner's layer listener on a prefill rank (`ModelRunner.layer_listener`).

    `board` returns the transport's board, or None when streaming is off; `on_started` (rank 0)
    publishes the preview. Owned by the engine thread."""

    def __init__(self, engine, board: Callable[[], ProgressBoard | None], on_started: StartedCallback | None = None,
                 packer=None):
        """`packer` (engine/handoff_pack.py): packs each layer's head slices before its mark."""
        self.engine = engine
        self.board = board
        self.on_started = on_started
        self.packer = packer

    def forward_started(self, out) -> Callable[[int], None] | None:
        """Open slots for the chunks of `out` that complete their prompt; returns the per-layer
        callback for this step's forward pass (None: nothing to mark as it goes)."""
        board = self.board()
        if board is None:
            return None
        live: list[tuple[int, int, str]] = []
        block_size = self.engine.block_size
        for chunk in out.chunks:
            req = chunk.request
            if chunk.start + chunk.num_tokens != req.prompt_len or req.output_token_ids or req.max_new_tokens <= 1:
                continue  # not the prompt's last chunk, or no handoff to come (generating; one token only)
            try:
                slot = board.open(req.request_id)
            except RuntimeError:  # board full: this handoff is published without streaming
                continue
            live.append((slot, req.prompt_len, req.request_id))
            num_blocks = -(-req.prompt_len // block_size)
            if self.packer is not None:  # before the preview: it names the packed memory
                self.packer.begin(req.request_id, req.block_ids[:num_blocks])
            if self.on_started is not None:
                self.on_started(req.request_id, slot, tuple(req.block_ids[:num_blocks]), req.prompt_len)
        if not live:
            return None
        if self.engine.runner.device.type == "cuda":
            return DeviceLayerMarks(board, live, self.packer)

        def layer_written(local_layer: int) -> None:
            for slot, num_tokens, request_id in live:
                if self.packer is not None:
                    self.packer.layers(request_id, local_layer, local_layer + 1)
                board.mark(slot, local_layer, None, (), num_tokens)

        return layer_written


class DeviceLayerMarks:
    """One GPU step's layer marks: called after each local layer is queued (records an event
    behind it on the current stream); `drain` waits for the events in order and marks each
    layer on the board as it completes. Engine thread only."""

    def __init__(self, board: ProgressBoard, live: list[tuple[int, int, str]], packer=None) -> None:
        import torch

        self._event = torch.cuda.Event
        self.board = board
        self.live = live
        self.packer = packer
        self.pending: list[tuple[int, object]] = []

    def __call__(self, local_layer: int) -> None:
        event = self._event()
        event.record()
        self.pending.append((local_layer, event))

    def drain(self) -> None:
        for local_layer, event in self.pending:
            event.synchronize()
            for slot, num_tokens, request_id in self.live:
                if self.packer is not None:
                    self.packer.layers(request_id, local_layer, local_layer + 1)
                self.board.mark(slot, local_layer, None, (), num_tokens)
        self.pending.clear()
