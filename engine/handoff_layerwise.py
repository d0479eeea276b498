"""Prefill side of layer-wise streaming: publish a pinned handoff's layers on the progress board
of this rank's transport (engine/transfer/progress.py), and give slots back when pins go.

    after a step, every prefill rank, for each request that reached its handoff:
      slot = board.open(request)                 same slot on every rank: every rank opens and
      for each local layer: board.mark(...)      closes in the same order, from the same outputs
      rank 0 puts `slot` in the descriptor
    after every step: slots of requests no longer pinned (acked, aborted, expired) are closed

Layers are marked once the step that finished the prompt is done, i.e. all at once: the
decode side is handed the descriptor only after prefill returns (the router calls Decode after
Prefill), so there is no earlier reader to serve. A decode side that starts before prefill
ends would need layers marked as the forward pass finishes each of them — the board, the
descriptor slot and the streamed pull already work that way (benchmarks/handoff.py measures it).
"""

from __future__ import annotations

from splitserve.engine.transfer.progress import ProgressBoard


def publish_layers(engine, board: ProgressBoard, handoff) -> int | None:
    """Open a slot for `handoff` and mark every local layer written (unit checksums included).

    Returns the slot, or None when the board is full (the handoff is then published without
    streaming and pulled all at once). Call on every rank of the prefill group."""
    try:
        slot = board.open(handoff.request_id)
    except RuntimeError:
        return None
    for layer, kv in enumerate(engine.kv_caches):
        board.mark(slot, layer, kv, handoff.block_ids, handoff.num_tokens)
    return slot


def close_released(engine, board: ProgressBoard) -> None:
    """Give back the slots of requests whose pins are gone (ack, abort, lease expiry)."""
    for request_id in board.open_requests():
        if request_id not in engine.handoffs:
            board.close(request_id)
