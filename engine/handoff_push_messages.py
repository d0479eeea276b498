"""The typed messages of the `torch_dist` handoff (engine/handoff_push.py): what the decode side
asks for (`PushRequest`, `StatePush` for a hybrid model's recurrent state), what the prefill side
answers (`PushGrant`, or `PushRefusedError`), and a rank's endpoint metadata."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from splitserve.engine.transfer.layout import KVLayout
from splitserve.engine.transfer.pair_group import BACKENDS
from splitserve.engine.transfer.state_plan import StateLayout
from splitserve.engine.transfer.transport import TransferError

_MAGIC = b"SSTD1"


class PushRefusedError(TransferError):
    """The prefill side decided not to push (nothing pinned, incompatible peers, too busy):
    nothing was sent, so the pair group's message stream is still in step and is kept."""


@dataclass(frozen=True)
class StatePush:
    """Hybrid models: push the request's recurrent state (not its KV) into this decode slot
    (handoff_push_state.py; mirrors the StatePush proto)."""

    dst_layout: StateLayout
    dst_slot: int
    """The request's state slot on every decode rank."""

    def __post_init__(self) -> None:
        if self.dst_slot < 0:
            raise ValueError(f"state push into slot {self.dst_slot!r}")


@dataclass(frozen=True)
class PushRequest:
    """Decode → prefill: push this request's KV to us (mirrors the PushKV proto)."""

    request_id: str
    dst_layout: KVLayout
    dst_block_ids: tuple[int, ...]
    """The request's block table on every decode rank (at least as long as the source's)."""
    first_block: int
    """Blocks before it are cached on the decode side and not sent."""
    decode_worker_id: str
    group_key: str | None
    """The key of the group the decode side has cached with this prefill worker, if any."""
    backend: str
    """gloo or nccl: where the decode side's KV lives; the prefill's must match."""
    timeout_s: float
    """Deadline of every wait of the push on both sides (rendezvous, each transfer)."""
    state: StatePush | None = None
    """Set: push the recurrent state instead of the KV (the block fields then name no blocks)."""

    def __post_init__(self) -> None:
        if not self.request_id or not self.decode_worker_id:
            raise ValueError(f"push needs a request id and a decode worker id, got {self.request_id!r}, "
                             f"{self.decode_worker_id!r}")
        if self.first_block < 0 or self.first_block > len(self.dst_block_ids):
            raise ValueError(f"first_block {self.first_block!r} out of range for {len(self.dst_block_ids)} blocks")
        if not self.timeout_s > 0:
            raise ValueError(f"push timeout must be > 0 s, got {self.timeout_s!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"push backend must be one of {BACKENDS}, got {self.backend!r}")


@dataclass(frozen=True)
class PushGrant:
    """Prefill → decode: the push will happen, over this group."""

    group_key: str
    store_path: str
    """The group's `FileStore` file (used only when the group is new)."""
    is_new_group: bool
    """False: both sides reuse their cached group with each other."""


@dataclass(frozen=True)
class TorchDistEndpoint:
    """A torch_dist rank's endpoint metadata (the descriptor's `agent_metadata`)."""

    worker_id: str
    """Identifies the worker (its rank 0 transport); pair groups are cached per peer worker."""
    backend: str
    gpu_uuid: str = ""
    """The rank's GPU ("" on CPU): NCCL cannot put two ranks of one group on one GPU."""

    def to_bytes(self) -> bytes:
        fields = {"worker_id": self.worker_id, "backend": self.backend, "gpu_uuid": self.gpu_uuid}
        return _MAGIC + json.dumps(fields).encode()

    @staticmethod
    def from_bytes(data: bytes) -> TorchDistEndpoint:
        if not data.startswith(_MAGIC):
            raise ValueError(f"not torch_dist endpoint metadata (starts {data[:8]!r})")
        fields = json.loads(data[len(_MAGIC):])
        return TorchDistEndpoint(worker_id=fields["worker_id"], backend=fields["backend"],
                                 gpu_uuid=fields.get("gpu_uuid", ""))


def _gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""


def shared_gpus(a: Iterable[TorchDistEndpoint], b: Iterable[TorchDistEndpoint]) -> set[str]:
    """GPUs holding a rank of both sides (NCCL refuses such a group: "Duplicate GPU detected")."""
    return ({e.gpu_uuid for e in a} & {e.gpu_uuid for e in b}) - {""}
