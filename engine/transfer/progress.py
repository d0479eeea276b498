"""Per-layer readiness of a handoff still being prefilled: the board a source rank publishes.

Each source rank owns one small int64 tensor, made and shared by its transport's `expose`
next to the KV pool (`KVTransport.board`; its location travels in the endpoint metadata), one
row per in-flight streamed handoff (a *slot*)::

    board[slot] = [ tag | ready[0] ... ready[L-1] | unit[0][0] ... unit[L-1][H-1] ]
                    │     │                          └─ checksum of (local layer i, local head j)
                    │     │                             over the request's blocks, valid once
                    │     │                             ready[i] == num_tokens
                    │     └─ tokens of the request whose KV of local layer i is written
                    └─ request_tag(request_id): a reader never mistakes a reused slot

The prefill side writes a layer's unit checksums, then its `ready` count (ready sits before
the units in the row, so a reader that copies the row front to back and sees `ready` complete
also sees that layer's units; a reader that cannot promise that order re-reads before it calls
a mismatch). The decode side polls the rows of the source ranks it reads
from and pulls each layer as soon as every one of them has it (`streaming.py`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve.engine.transfer.checksum import _checksum_rows, _words


def request_tag(request_id: str) -> int:
    """A non-zero 62-bit tag of a request id (0 marks a free slot)."""
    value = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "little") & ((1 << 62) - 1)
    return value or 1


@dataclass(frozen=True)
class BoardShape:
    """Geometry of one rank's board; the same on both sides (from the layout)."""

    num_slots: int
    num_layers: int
    """Local layers of the source rank."""
    num_heads: int
    """Local kv heads of the source rank."""

    def __post_init__(self) -> None:
        for name in ("num_slots", "num_layers", "num_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"BoardShape.{name} must be >= 1, got {getattr(self, name)!r}")

    @property
    def width(self) -> int:
        return 1 + self.num_layers + self.num_layers * self.num_heads


@dataclass(frozen=True)
class RowView:
    """One slot's row as the decode side read it."""

    tag: int
    ready: tuple[int, ...]
    units: tuple[tuple[int, ...], ...]
    """[local layer][local head] checksums."""

    @staticmethod
    def parse(row: Sequence[int], shape: BoardShape) -> RowView:
        row = [int(v) for v in row]
        nl, nh = shape.num_layers, shape.num_heads
        units = tuple(tuple(row[1 + nl + i * nh: 1 + nl + (i + 1) * nh]) for i in range(nl))
        return RowView(row[0], tuple(row[1:1 + nl]), units)

    def num_ready_layers(self, tag: int, num_tokens: int) -> int:
        """Leading local layers complete for the request tagged `tag` (0 if the slot is someone else's)."""
        if self.tag != tag:
            return 0
        n = 0
        while n < len(self.ready) and self.ready[n] >= num_tokens:
            n += 1
        return n


NUM_BOARD_SLOTS = 64
"""Default slots per board: streamed handoffs a source rank can have in flight at once."""


class ProgressBoard:
    """The source rank's board: slot allocation and writes. Owned by the engine thread."""

    @staticmethod
    def for_pool(kv_tensors: Sequence[torch.Tensor], num_slots: int = NUM_BOARD_SLOTS) -> ProgressBoard:
        """A board sized for a rank's per-layer KV tensors `[2, P, heads, block_size, head_dim]`."""
        return ProgressBoard(BoardShape(num_slots, len(kv_tensors), kv_tensors[0].shape[2]))

    def __init__(self, shape: BoardShape):
        self.shape = shape
        self.tensor = torch.zeros(shape.num_slots, shape.width, dtype=torch.int64)
        self._free = list(range(shape.num_slots - 1, -1, -1))
        self._slots: dict[str, int] = {}

    def open(self, request_id: str) -> int:
        """Claim a slot for `request_id` (its row zeroed, then tagged). Raises when all are taken."""
        if request_id in self._slots:
            return self._slots[request_id]
        if not self._free:
            raise RuntimeError(f"all {self.shape.num_slots} progress slots are in use")
        slot = self._free.pop()
        self.tensor[slot].zero_()
        self.tensor[slot, 0] = request_tag(request_id)
        self._slots[request_id] = slot
        return slot

    def slot_of(self, request_id: str) -> int | None:
        return self._slots.get(request_id)

    def open_requests(self) -> list[str]:
        """Request ids holding a slot, oldest first."""
        return list(self._slots)

    def close(self, request_id: str) -> None:
        """Give the slot back (on ack, abort or lease expiry); its row is cleared first."""
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self.tensor[slot].zero_()
            self._free.append(slot)

    def mark(self, slot: int, layer: int, kv_layer: torch.Tensor | None, block_ids: Sequence[int],
             num_tokens: int) -> None:
        """Local `layer` of the request in `slot` is written for `num_tokens` tokens: publish its
        unit checksums over `block_ids`, then its ready count (that order, see the module doc).
        `kv_layer=None` publishes readiness only (benchmarks; readers must not verify then)."""
        nl, nh = self.shape.num_layers, self.shape.num_heads
        if kv_layer is not None:
            start = 1 + nl + layer * nh
            self.tensor[slot, start:start + nh] = layer_unit_checksums(kv_layer, block_ids).to(self.tensor.device)
        self.tensor[slot, 1 + layer] = num_tokens


def layer_unit_checksums(kv_layer: torch.Tensor, block_ids: Sequence[int], heads: Sequence[int] | None = None
                         ) -> torch.Tensor:
    """Checksums of one layer tensor's (local) heads over `block_ids`: int64 [num heads].

    The same unit definition as `checksum.unit_checksums` (K and V of all the blocks, in order).
    """
    idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=kv_layer.device)
    x = kv_layer.index_select(1, idx)
    if heads is not None:
        x = x.index_select(2, torch.as_tensor(list(heads), dtype=torch.long, device=kv_layer.device))
    rows = _words(x.permute(2, 0, 1, 3, 4)).reshape(x.shape[2], -1)
    return _checksum_rows(rows)
