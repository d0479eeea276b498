from splitserve.proto.v1 import common_pb2 as _common_pb2
from splitserve.proto.v1 import handoff_pb2 as _handoff_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling_params", "decode_worker_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    decode_worker_id: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., decode_worker_id: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("handoff", "num_cached_tokens", "finish_reason")
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    handoff: _handoff_pb2.HandoffDescriptor
    num_cached_tokens: int
    finish_reason: _common_pb2.FinishReason
    def __init__(self, handoff: _Optional[_Union[_handoff_pb2.HandoffDescriptor, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ...) -> None: ...

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
    __slots__ = ("block_hashes", "block_size", "event_sequence")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    event_sequence: int
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., event_sequence: _Optional[int] = ...) -> None: ...
