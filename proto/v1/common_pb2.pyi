from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("num_tokens_to_generate", "temperature", "top_k", "top_p", "seed", "termination_ids", "stop_words", "return_log_probs", "top_n_logprobs", "output_offset", "logit_bias", "presence_penalty", "frequency_penalty", "return_prompt_log_probs", "json_schema", "grammar")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    NUM_TOKENS_TO_GENERATE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TERMINATION_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_WORDS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROMPT_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    num_tokens_to_generate: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    termination_ids: _containers.RepeatedScalarFieldContainer[int]
    stop_words: _containers.RepeatedScalarFieldContainer[str]
    return_log_probs: bool
    top_n_logprobs: int
    output_offset: int
    logit_bias: _containers.ScalarMap[int, float]
    presence_penalty: float
    frequency_penalty: float
    return_prompt_log_probs: bool
    json_schema: str
    grammar: str
    def __init__(self, num_tokens_to_generate: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., termination_ids: _Optional[_Iterable[int]] = ..., stop_words: _Optional[_Iterable[str]] = ..., return_log_probs: _Optional[bool] = ..., top_n_logprobs: _Optional[int] = ..., output_offset: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., return_prompt_log_probs: _Optional[bool] = ..., json_schema: _Optional[str] = ..., grammar: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenTopLogprobs(_message.Message):
    __slots__ = ("top_logprobs",)
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("logprobs", "top_logprobs")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenTopLogprobs]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenTopLogprobs, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("was_found",)
    WAS_FOUND_FIELD_NUMBER: _ClassVar[int]
    was_found: bool
    def __init__(self, was_found: _Optional[bool] = ...) -> None: ...

class IntegrityRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IntegrityReport(_message.Message):
    __slots__ = ("is_ok", "problem", "num_blocks", "num_free_blocks", "num_cached_blocks", "num_in_use_blocks", "num_pinned_blocks", "num_requests", "num_handoffs", "num_in_flight", "is_draining", "pid")
    IS_OK_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_USE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    IS_DRAINING_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    is_ok: bool
    problem: str
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_in_use_blocks: int
    num_pinned_blocks: int
    num_requests: int
    num_handoffs: int
    num_in_flight: int
    is_draining: bool
    pid: int
    def __init__(self, is_ok: _Optional[bool] = ..., problem: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., num_in_use_blocks: _Optional[int] = ..., num_pinned_blocks: _Optional[int] = ..., num_requests: _Optional[int] = ..., num_handoffs: _Optional[int] = ..., num_in_flight: _Optional[int] = ..., is_draining: _Optional[bool] = ..., pid: _Optional[int] = ...) -> None: ...
