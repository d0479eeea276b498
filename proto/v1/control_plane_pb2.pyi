from splitserve.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LifecycleState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LIFECYCLE_STATE_UNSPECIFIED: _ClassVar[LifecycleState]
    LIFECYCLE_STATE_RUNNING: _ClassVar[LifecycleState]
    LIFECYCLE_STATE_PAUSED: _ClassVar[LifecycleState]
    LIFECYCLE_STATE_SUSPENDED: _ClassVar[LifecycleState]

class LifecycleAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LIFECYCLE_ACTION_UNSPECIFIED: _ClassVar[LifecycleAction]
    LIFECYCLE_ACTION_PAUSE: _ClassVar[LifecycleAction]
    LIFECYCLE_ACTION_UNPAUSE: _ClassVar[LifecycleAction]
    LIFECYCLE_ACTION_SUSPEND: _ClassVar[LifecycleAction]
    LIFECYCLE_ACTION_RESUME: _ClassVar[LifecycleAction]
    LIFECYCLE_ACTION_RELOAD_WEIGHTS: _ClassVar[LifecycleAction]
LIFECYCLE_STATE_UNSPECIFIED: LifecycleState
LIFECYCLE_STATE_RUNNING: LifecycleState
LIFECYCLE_STATE_PAUSED: LifecycleState
LIFECYCLE_STATE_SUSPENDED: LifecycleState
LIFECYCLE_ACTION_UNSPECIFIED: LifecycleAction
LIFECYCLE_ACTION_PAUSE: LifecycleAction
LIFECYCLE_ACTION_UNPAUSE: LifecycleAction
LIFECYCLE_ACTION_SUSPEND: LifecycleAction
LIFECYCLE_ACTION_RESUME: LifecycleAction
LIFECYCLE_ACTION_RELOAD_WEIGHTS: LifecycleAction

class RegisterRequest(_message.Message):
    __slots__ = ("worker_id", "address", "role", "num_gpu_ranks", "lease_id", "preferred_slot_ids", "kv_events_endpoint", "kv_block_size")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_RANKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_SLOT_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    role: _common_pb2.Role
    num_gpu_ranks: int
    lease_id: int
    preferred_slot_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_events_endpoint: str
    kv_block_size: int
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., num_gpu_ranks: _Optional[int] = ..., lease_id: _Optional[int] = ..., preferred_slot_ids: _Optional[_Iterable[int]] = ..., kv_events_endpoint: _Optional[str] = ..., kv_block_size: _Optional[int] = ...) -> None: ...

class Slot(_message.Message):
    __slots__ = ("slot_id", "group_index", "role", "dp_replica", "tp_rank", "pp_rank", "tp", "pp")
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DP_REPLICA_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    slot_id: int
    group_index: int
    role: _common_pb2.Role
    dp_replica: int
    tp_rank: int
    pp_rank: int
    tp: int
    pp: int
    def __init__(self, slot_id: _Optional[int] = ..., group_index: _Optional[int] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., dp_replica: _Optional[int] = ..., tp_rank: _Optional[int] = ..., pp_rank: _Optional[int] = ..., tp: _Optional[int] = ..., pp: _Optional[int] = ...) -> None: ...

class Peer(_message.Message):
    __slots__ = ("rank", "worker_id", "address")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    worker_id: str
    address: str
    def __init__(self, rank: _Optional[int] = ..., worker_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("worker_id", "lease_id", "slots", "peers", "revision")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    lease_id: int
    slots: _containers.RepeatedCompositeFieldContainer[Slot]
    peers: _containers.RepeatedCompositeFieldContainer[Peer]
    revision: int
    def __init__(self, worker_id: _Optional[str] = ..., lease_id: _Optional[int] = ..., slots: _Optional[_Iterable[_Union[Slot, _Mapping]]] = ..., peers: _Optional[_Iterable[_Union[Peer, _Mapping]]] = ..., revision: _Optional[int] = ...) -> None: ...

class GetTopologyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchTopologyRequest(_message.Message):
    __slots__ = ("after_revision",)
    AFTER_REVISION_FIELD_NUMBER: _ClassVar[int]
    after_revision: int
    def __init__(self, after_revision: _Optional[int] = ...) -> None: ...

class LifecycleStatus(_message.Message):
    __slots__ = ("state", "weights_version", "checkpoint_path")
    STATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    state: LifecycleState
    weights_version: int
    checkpoint_path: str
    def __init__(self, state: _Optional[_Union[LifecycleState, str]] = ..., weights_version: _Optional[int] = ..., checkpoint_path: _Optional[str] = ...) -> None: ...

class SlotStatus(_message.Message):
    __slots__ = ("slot", "worker_id")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    slot: Slot
    worker_id: str
    def __init__(self, slot: _Optional[_Union[Slot, _Mapping]] = ..., worker_id: _Optional[str] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "address", "role", "num_gpu_ranks", "slot_ids", "is_draining", "lease_id", "kv_events_endpoint", "kv_block_size")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_RANKS_FIELD_NUMBER: _ClassVar[int]
    SLOT_IDS_FIELD_NUMBER: _ClassVar[int]
    IS_DRAINING_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    role: _common_pb2.Role
    num_gpu_ranks: int
    slot_ids: _containers.RepeatedScalarFieldContainer[int]
    is_draining: bool
    lease_id: int
    kv_events_endpoint: str
    kv_block_size: int
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., num_gpu_ranks: _Optional[int] = ..., slot_ids: _Optional[_Iterable[int]] = ..., is_draining: _Optional[bool] = ..., lease_id: _Optional[int] = ..., kv_events_endpoint: _Optional[str] = ..., kv_block_size: _Optional[int] = ...) -> None: ...

class Topology(_message.Message):
    __slots__ = ("revision", "inference_shards", "lifecycle", "slots", "workers", "leader_id", "leader_address")
    REVISION_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_SHARDS_FIELD_NUMBER: _ClassVar[int]
    LIFECYCLE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    revision: int
    inference_shards: str
    lifecycle: LifecycleStatus
    slots: _containers.RepeatedCompositeFieldContainer[SlotStatus]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    leader_id: str
    leader_address: str
    def __init__(self, revision: _Optional[int] = ..., inference_shards: _Optional[str] = ..., lifecycle: _Optional[_Union[LifecycleStatus, _Mapping]] = ..., slots: _Optional[_Iterable[_Union[SlotStatus, _Mapping]]] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., leader_id: _Optional[str] = ..., leader_address: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("revision",)
    REVISION_FIELD_NUMBER: _ClassVar[int]
    revision: int
    def __init__(self, revision: _Optional[int] = ...) -> None: ...

class LifecycleRequest(_message.Message):
    __slots__ = ("action", "checkpoint_path")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    action: LifecycleAction
    checkpoint_path: str
    def __init__(self, action: _Optional[_Union[LifecycleAction, str]] = ..., checkpoint_path: _Optional[str] = ...) -> None: ...

class LifecycleResponse(_message.Message):
    __slots__ = ("lifecycle", "revision")
    LIFECYCLE_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    lifecycle: LifecycleStatus
    revision: int
    def __init__(self, lifecycle: _Optional[_Union[LifecycleStatus, _Mapping]] = ..., revision: _Optional[int] = ...) -> None: ...
