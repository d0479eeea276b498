from splitserve.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling_params", "return_timing", "enforce_disagg")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    RETURN_TIMING_FIELD_NUMBER: _ClassVar[int]
    ENFORCE_DISAGG_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    return_timing: bool
    enforce_disagg: bool
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., return_timing: _Optional[bool] = ..., enforce_disagg: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class RoutingSummary(_message.Message):
    __slots__ = ("prefill_worker_id", "decode_worker_id", "predicted_cached_tokens", "reason", "num_prefill_attempts", "num_decode_attempts", "num_transfer_blocks")
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    prefill_worker_id: str
    decode_worker_id: str
    predicted_cached_tokens: int
    reason: str
    num_prefill_attempts: int
    num_decode_attempts: int
    num_transfer_blocks: int
    def __init__(self, prefill_worker_id: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., predicted_cached_tokens: _Optional[int] = ..., reason: _Optional[str] = ..., num_prefill_attempts: _Optional[int] = ..., num_decode_attempts: _Optional[int] = ..., num_transfer_blocks: _Optional[int] = ...) -> None: ...

class TimingSummary(_message.Message):
    __slots__ = ("route_ms", "prefill_ms", "time_to_first_token_ms", "total_ms", "phases", "trace_id", "kv_transfer_bytes", "kv_transfer_gbps")
    ROUTE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_GBPS_FIELD_NUMBER: _ClassVar[int]
    route_ms: float
    prefill_ms: float
    time_to_first_token_ms: float
    total_ms: float
    phases: _containers.RepeatedCompositeFieldContainer[TimingPhase]
    trace_id: str
    kv_transfer_bytes: int
    kv_transfer_gbps: float
    def __init__(self, route_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., time_to_first_token_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., phases: _Optional[_Iterable[_Union[TimingPhase, _Mapping]]] = ..., trace_id: _Optional[str] = ..., kv_transfer_bytes: _Optional[int] = ..., kv_transfer_gbps: _Optional[float] = ...) -> None: ...

class TimingPhase(_message.Message):
    __slots__ = ("name", "ms", "is_ttft")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    IS_TTFT_FIELD_NUMBER: _ClassVar[int]
    name: str
    ms: float
    is_ttft: bool
    def __init__(self, name: _Optional[str] = ..., ms: _Optional[float] = ..., is_ttft: _Optional[bool] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "top_logprobs", "finish_reason", "usage", "routing", "timing", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenTopLogprobs]
    finish_reason: _common_pb2.FinishReason
    usage: Usage
    routing: RoutingSummary
    timing: TimingSummary
    prompt_logprobs: _common_pb2.PromptLogprobs
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenTopLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., routing: _Optional[_Union[RoutingSummary, _Mapping]] = ..., timing: _Optional[_Union[TimingSummary, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.PromptLogprobs, _Mapping]] = ...) -> None: ...
