from splitserve.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LayerRange(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("dtype", "block_size", "tp", "pp", "num_layers", "num_kv_heads", "head_dim", "layer_ranges")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    LAYER_RANGES_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    block_size: int
    tp: int
    pp: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_ranges: _containers.RepeatedCompositeFieldContainer[LayerRange]
    def __init__(self, dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., tp: _Optional[int] = ..., pp: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., layer_ranges: _Optional[_Iterable[_Union[LayerRange, _Mapping]]] = ...) -> None: ...

class RankBlocks(_message.Message):
    __slots__ = ("rank", "block_ids")
    RANK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rank: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RankEndpoint(_message.Message):
    __slots__ = ("rank", "address", "agent_metadata")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    rank: int
    address: str
    agent_metadata: bytes
    def __init__(self, rank: _Optional[int] = ..., address: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ...) -> None: ...

class UnitChecksum(_message.Message):
    __slots__ = ("layer", "kv_head", "value")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    layer: int
    kv_head: int
    value: int
    def __init__(self, layer: _Optional[int] = ..., kv_head: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...

class StateLayout(_message.Message):
    __slots__ = ("tp", "pp", "num_layers", "layer_ranges", "num_heads", "head_dim", "num_groups", "state_size", "conv_width", "conv_dtype", "ssm_dtype")
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LAYER_RANGES_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    STATE_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONV_WIDTH_FIELD_NUMBER: _ClassVar[int]
    CONV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SSM_DTYPE_FIELD_NUMBER: _ClassVar[int]
    tp: int
    pp: int
    num_layers: int
    layer_ranges: _containers.RepeatedCompositeFieldContainer[LayerRange]
    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_width: int
    conv_dtype: str
    ssm_dtype: str
    def __init__(self, tp: _Optional[int] = ..., pp: _Optional[int] = ..., num_layers: _Optional[int] = ..., layer_ranges: _Optional[_Iterable[_Union[LayerRange, _Mapping]]] = ..., num_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., num_groups: _Optional[int] = ..., state_size: _Optional[int] = ..., conv_width: _Optional[int] = ..., conv_dtype: _Optional[str] = ..., ssm_dtype: _Optional[str] = ...) -> None: ...

class StateEndpoint(_message.Message):
    __slots__ = ("rank", "data")
    RANK_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    rank: int
    data: bytes
    def __init__(self, rank: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class StateHandoff(_message.Message):
    __slots__ = ("layout", "slot", "checksum", "endpoints")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    layout: StateLayout
    slot: int
    checksum: int
    endpoints: _containers.RepeatedCompositeFieldContainer[StateEndpoint]
    def __init__(self, layout: _Optional[_Union[StateLayout, _Mapping]] = ..., slot: _Optional[int] = ..., checksum: _Optional[int] = ..., endpoints: _Optional[_Iterable[_Union[StateEndpoint, _Mapping]]] = ...) -> None: ...

class HandoffDescriptor(_message.Message):
    __slots__ = ("request_id", "model_fingerprint", "layout", "rank_blocks", "num_tokens", "transport_kind", "rank_endpoints", "first_token_id", "first_token_logprob", "first_token_top_logprobs", "lease_deadline_unix_ms", "unit_checksums", "block_checksums", "progress_slot", "state")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    RANK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_KIND_FIELD_NUMBER: _ClassVar[int]
    RANK_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    UNIT_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_SLOT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_fingerprint: str
    layout: KVLayout
    rank_blocks: _containers.RepeatedCompositeFieldContainer[RankBlocks]
    num_tokens: int
    transport_kind: str
    rank_endpoints: _containers.RepeatedCompositeFieldContainer[RankEndpoint]
    first_token_id: int
    first_token_logprob: float
    first_token_top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprob]
    lease_deadline_unix_ms: int
    unit_checksums: _containers.RepeatedCompositeFieldContainer[UnitChecksum]
    block_checksums: _containers.RepeatedScalarFieldContainer[int]
    progress_slot: int
    state: StateHandoff
    def __init__(self, request_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., rank_blocks: _Optional[_Iterable[_Union[RankBlocks, _Mapping]]] = ..., num_tokens: _Optional[int] = ..., transport_kind: _Optional[str] = ..., rank_endpoints: _Optional[_Iterable[_Union[RankEndpoint, _Mapping]]] = ..., first_token_id: _Optional[int] = ..., first_token_logprob: _Optional[float] = ..., first_token_top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprob, _Mapping]]] = ..., lease_deadline_unix_ms: _Optional[int] = ..., unit_checksums: _Optional[_Iterable[_Union[UnitChecksum, _Mapping]]] = ..., block_checksums: _Optional[_Iterable[int]] = ..., progress_slot: _Optional[int] = ..., state: _Optional[_Union[StateHandoff, _Mapping]] = ...) -> None: ...
