"""What a NIXL source rank publishes (the bytes of a descriptor's `agent_metadata`): its agent's
metadata, where each local layer's KV tensor lives, and where its progress board lives.

    b"SSNX1" | u32 header length | JSON header | raw NIXL agent metadata
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from splitserve.engine.transfer.source_pack import PackedSource

_MAGIC = b"SSNX1"


@dataclass(frozen=True)
class NixlEndpoint:
    """What a source rank publishes: its agent and where each local layer's KV tensor lives."""

    agent_metadata: bytes
    mem_type: str
    """"DRAM" or "VRAM"."""
    device_id: int
    layer_addrs: tuple[int, ...]
    layer_shape: tuple[int, ...]
    """Shape of every layer tensor, `[2, pool, local heads, block_size, head_dim]`."""
    dtype: str
    board_addr: int = 0
    """Address of the rank's progress board (DRAM, int64 [board_slots, board_width]); 0: none."""
    board_slots: int = 0
    board_width: int = 0
    packed: PackedSource | None = None
    """One request's head slices packed on this rank (`source_pack.py`); None: read the pool."""
    ipc_host: str = ""
    ipc_handles: str = ""
    """A VRAM pool's host identity and CUDA IPC handles (`nixl_same_host.py`); "": none."""

    def __post_init__(self) -> None:
        if self.mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"mem_type must be DRAM or VRAM, got {self.mem_type!r}")
        if len(self.layer_shape) != 5 or not self.layer_addrs:
            raise ValueError(f"bad endpoint: layer_shape {self.layer_shape!r}, {len(self.layer_addrs)} layers")

    def to_bytes(self) -> bytes:
        header = json.dumps({
            "mem_type": self.mem_type, "device_id": self.device_id, "layer_addrs": list(self.layer_addrs),
            "layer_shape": list(self.layer_shape), "dtype": self.dtype,
            "board": [self.board_addr, self.board_slots, self.board_width],
            **({"packed": self.packed.to_json()} if self.packed is not None else {}),
            **({"ipc": [self.ipc_host, self.ipc_handles]} if self.ipc_handles else {}),
        }).encode()
        return _MAGIC + struct.pack("<I", len(header)) + header + self.agent_metadata

    @staticmethod
    def from_bytes(data: bytes) -> NixlEndpoint:
        if not data.startswith(_MAGIC) or len(data) < len(_MAGIC) + 4:
            raise ValueError(f"not NIXL endpoint metadata (starts {data[:8]!r})")
        (size,) = struct.unpack_from("<I", data, len(_MAGIC))
        start = len(_MAGIC) + 4
        header = json.loads(data[start:start + size])
        board_addr, board_slots, board_width = header.get("board", (0, 0, 0))
        ipc_host, ipc_handles = header.get("ipc", ("", ""))
        return NixlEndpoint(
            agent_metadata=data[start + size:], mem_type=header["mem_type"], device_id=header["device_id"],
            layer_addrs=tuple(header["layer_addrs"]), layer_shape=tuple(header["layer_shape"]),
            dtype=header["dtype"], board_addr=board_addr, board_slots=board_slots, board_width=board_width,
            packed=PackedSource.from_json(header["packed"]) if "packed" in header else None,
            ipc_host=ipc_host, ipc_handles=ipc_handles,
        )
