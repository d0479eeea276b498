"""The values stored in etcd, as frozen dataclasses with their JSON codec.

JSON rather than protobuf so that `etcdctl get --prefix /splitserve` is
readable while debugging; every record is encoded and decoded here only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from splitserve.control_plane.keys import check_name
from splitserve.control_plane.shard_spec import Role


def _check_address(value: object) -> None:
    host, sep, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address must be host:port, got {value!r}")


@dataclass(frozen=True)
class WorkerRecord:
    """What a worker announced when it registered (stored at workers/<worker_id>)."""

    worker_id: str
    address: str
    """The worker's gRPC address, host:port."""
    role: Role | None = None
    """The role it accepts; None = any."""
    num_gpu_ranks: int = 1
    """GPU ranks the process drives (it holds that many consecutive slots)."""
    kv_events_endpoint: str | None = None
    """ZMQ PUB endpoint of the worker's KV-event publisher (routers subscribe); None = no events."""
    kv_block_size: int | None = None
    """Tokens per KV block of the worker's prefix cache; None = not advertised."""

    def __post_init__(self) -> None:
        check_name("worker_id", self.worker_id)
        _check_address(self.address)
        if self.role is not None and not isinstance(self.role, Role):
            raise ValueError(f"role must be a Role or None, got {self.role!r}")
        if not isinstance(self.num_gpu_ranks, int) or self.num_gpu_ranks < 1:
            raise ValueError(f"num_gpu_ranks must be a positive integer, got {self.num_gpu_ranks!r}")
        if self.kv_events_endpoint is not None and (
            not isinstance(self.kv_events_endpoint, str) or "://" not in self.kv_events_endpoint
        ):
            raise ValueError(f"kv_events_endpoint must be a ZMQ endpoint like tcp://host:port, got {self.kv_events_endpoint!r}")
        if self.kv_block_size is not None and (not isinstance(self.kv_block_size, int) or self.kv_block_size < 1):
            raise ValueError(f"kv_block_size must be a positive integer or None, got {self.kv_block_size!r}")

    def encode(self) -> bytes:
        role = None if self.role is None else self.role.value
        fields = {"worker_id": self.worker_id, "address": self.address, "role": role}
        fields["num_gpu_ranks"] = self.num_gpu_ranks
        # Written only when set, so records stay readable by older code.
        if self.kv_events_endpoint is not None:
            fields["kv_events_endpoint"] = self.kv_events_endpoint
        if self.kv_block_size is not None:
            fields["kv_block_size"] = self.kv_block_size
        return json.dumps(fields, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> WorkerRecord:
        fields = json.loads(data)
        role = fields["role"]
        return cls(
            worker_id=fields["worker_id"],
            address=fields["address"],
            role=None if role is None else Role(role),
            num_gpu_ranks=fields["num_gpu_ranks"],
            kv_events_endpoint=fields.get("kv_events_endpoint"),
            kv_block_size=fields.get("kv_block_size"),
        )


@dataclass(frozen=True)
class LeaderRecord:
    """The control-plane replica that leads (stored at leader, on its lease)."""

    replica_id: str
    address: str
    """gRPC address clients should send leader-only calls to."""

    def __post_init__(self) -> None:
        check_name("replica_id", self.replica_id)
        _check_address(self.address)

    def encode(self) -> bytes:
        return json.dumps({"replica_id": self.replica_id, "address": self.address}, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> LeaderRecord:
        fields = json.loads(data)
        return cls(replica_id=fields["replica_id"], address=fields["address"])
