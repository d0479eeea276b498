from splitserve.proto.v1 import common_pb2 as _common_pb2
from splitserve.proto.v1 import handoff_pb2 as _handoff_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling_params", "decode_worker_id", "decode_tp")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_TP_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    decode_worker_id: str
    decode_tp: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., decode_worker_id: _Optional[str] = ..., decode_tp: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("handoff", "num_cached_tokens", "finish_reason", "timing")
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    handoff: _handoff_pb2.HandoffDescriptor
    num_cached_tokens: int
    finish_reason: _common_pb2.FinishReason
    timing: PrefillTiming
    def __init__(self, handoff: _Optional[_Union[_handoff_pb2.HandoffDescriptor, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., timing: _Optional[_Union[PrefillTiming, _Mapping]] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("first_token", "response", "handoff_started")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_STARTED_FIELD_NUMBER: _ClassVar[int]
    first_token: PrefillFirstToken
    response: PrefillResponse
    handoff_started: _handoff_pb2.HandoffDescriptor
    def __init__(self, first_token: _Optional[_Union[PrefillFirstToken, _Mapping]] = ..., response: _Optional[_Union[PrefillResponse, _Mapping]] = ..., handoff_started: _Optional[_Union[_handoff_pb2.HandoffDescriptor, _Mapping]] = ...) -> None: ...

class PrefillFirstToken(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs", "finish_reason", "prompt_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprob]
    finish_reason: _common_pb2.FinishReason
    prompt_logprobs: _common_pb2.PromptLogprobs
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.PromptLogprobs, _Mapping]] = ...) -> None: ...

class PrefillTiming(_message.Message):
    __slots__ = ("handler_ms", "queue_ms", "compute_ms", "publish_ms", "num_chunks", "first_token_ms")
    HANDLER_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    handler_ms: float
    queue_ms: float
    compute_ms: float
    publish_ms: float
    num_chunks: int
    first_token_ms: float
    def __init__(self, handler_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ..., publish_ms: _Optional[float] = ..., num_chunks: _Optional[int] = ..., first_token_ms: _Optional[float] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("was_pinned",)
    WAS_PINNED_FIELD_NUMBER: _ClassVar[int]
    was_pinned: bool
    def __init__(self, was_pinned: _Optional[bool] = ...) -> None: ...

class GetBlockSetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BlockSet(_message.Message):
    __slots__ = ("block_hashes", "block_size", "event_sequence", "block_digests")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    event_sequence: int
    block_digests: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., event_sequence: _Optional[int] = ..., block_digests: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PushKVRequest(_message.Message):
    __slots__ = ("request_id", "dst_layout", "dst_block_ids", "first_block", "decode_worker_id", "group_key", "backend", "timeout_ms", "state")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DST_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_KEY_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    dst_layout: _handoff_pb2.KVLayout
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    first_block: int
    decode_worker_id: str
    group_key: str
    backend: str
    timeout_ms: int
    state: StatePush
    def __init__(self, request_id: _Optional[str] = ..., dst_layout: _Optional[_Union[_handoff_pb2.KVLayout, _Mapping]] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., first_block: _Optional[int] = ..., decode_worker_id: _Optional[str] = ..., group_key: _Optional[str] = ..., backend: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., state: _Optional[_Union[StatePush, _Mapping]] = ...) -> None: ...

class StatePush(_message.Message):
    __slots__ = ("dst_layout", "dst_slot")
    DST_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DST_SLOT_FIELD_NUMBER: _ClassVar[int]
    dst_layout: _handoff_pb2.StateLayout
    dst_slot: int
    def __init__(self, dst_layout: _Optional[_Union[_handoff_pb2.StateLayout, _Mapping]] = ..., dst_slot: _Optional[int] = ...) -> None: ...

class PushKVResponse(_message.Message):
    __slots__ = ("group_key", "store_path", "is_new_group")
    GROUP_KEY_FIELD_NUMBER: _ClassVar[int]
    STORE_PATH_FIELD_NUMBER: _ClassVar[int]
    IS_NEW_GROUP_FIELD_NUMBER: _ClassVar[int]
    group_key: str
    store_path: str
    is_new_group: bool
    def __init__(self, group_key: _Optional[str] = ..., store_path: _Optional[str] = ..., is_new_group: _Optional[bool] = ...) -> None: ...
