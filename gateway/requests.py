"""OpenAI request bodies as strict pydantic models (no coercion: "5" is not an int, 1 is not a bool).

Unknown fields are ignored, as OpenAI-compatible servers commonly do; known
OpenAI fields splitserve cannot honour are accepted at their neutral value and
refused otherwise, with a message that names them. Fields whose wrong shapes
would give confusing union errors (prompt, stop, message content, tool_choice)
are checked by hand first. Limits that depend on the served model (context
length, vocabulary) are checked later, in prompts.py.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from splitserve.engine.guided import compile_schema
from splitserve.engine.logit_adjustments import BIAS_RANGE, PENALTY_RANGE
from splitserve.gateway.errors import bad_request

MAX_N = 16
"""Choices per request (and prompts x choices per completion request: MAX_N * MAX_PROMPTS)."""
MAX_PROMPTS = 64
MAX_STOP = 16
MAX_LOGIT_BIAS = 300
"""Tokens one request may bias (OpenAI's limit)."""
MAX_TOKENS_LIMIT = 1 << 24
"""Absurd-value guard; the real bound is the model's context (prompts.py)."""


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False
    """Send one more chunk before [DONE] with the usage of the whole request (and `choices: []`)."""


def _check_stop(value: Any) -> Any:
    if value is None or (isinstance(value, str) and value):
        return value
    if isinstance(value, list) and len(value) <= MAX_STOP and all(isinstance(s, str) and s for s in value):
        return value
    raise bad_request(
        f"stop must be a non-empty string or a list of at most {MAX_STOP} non-empty strings, got {_show(value)}", "stop"
    )


class JsonSchemaFormat(_Strict):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: str
    json_schema: JsonSchemaFormat | None = None

    def schema_text(self) -> str | None:
        """The JSON schema the output must follow (engine/guided.py), None for free text.
        APIError for an unknown type or a json_schema format without its schema."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return '{"type": "object"}'
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise bad_request("response_format json_schema needs json_schema.schema", "response_format")
            schema = json.dumps(self.json_schema.schema_)
            try:
                compile_schema(schema)
            except ValueError as exc:
                raise bad_request(str(exc), "response_format") from None
            return schema
        raise bad_request(f"response_format type must be 'text', 'json_object' or 'json_schema', got {self.type!r}",
                          "response_format")  # fmt: skip


class SamplingFields(_Strict):
    """What completions and chat share."""

    model: str | None = Field(default=None, description="The served model's name (GET /v1/models); another name is a 404.")
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description="0 = greedy; default 1.")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description="Nucleus threshold; default 1 (off).")
    top_k: int | None = Field(default=None, ge=-1, le=1 << 20, description="Extra: keep the k most likely tokens; 0 or -1 = off.")
    n: int = Field(default=1, ge=1, le=MAX_N, description="Choices to generate for each prompt.")
    seed: int | None = Field(default=None, ge=0, lt=1 << 63, description="Sampling seed; choice i uses seed + i.")
    stop: str | list[str] | None = Field(default=None, description=f"Up to {MAX_STOP} strings that end the output (not included).")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1],
                                    description="Subtracted from the logits of tokens the output already holds.")
    frequency_penalty: float = Field(default=0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1],
                                     description="Subtracted once per occurrence of a token in the output so far.")
    logit_bias: dict[str, float] | None = Field(
        default=None, description=f"Token id (a string) → bias in [-100, 100] added to its logit; at most {MAX_LOGIT_BIAS}.")
    user: str | None = None
    response_format: ResponseFormat | None = Field(
        default=None, description="text, json_object or json_schema: the output follows it (completions too, as vLLM).")

    @field_validator("stop", mode="before")
    @classmethod
    def _validate_stop(cls, value: Any) -> Any:
        return _check_stop(value)

    @model_validator(mode="after")
    def _unsupported(self):
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        if self.response_format is not None:
            self.response_format.schema_text()  # refused here, before any work, when malformed
        return self

    @property
    def json_schema(self) -> str | None:
        """The schema of `response_format` (None: free text)."""
        return None if self.response_format is None else self.response_format.schema_text()

    @field_validator("logit_bias", mode="after")
    @classmethod
    def _validate_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if not value:
            return value
        if len(value) > MAX_LOGIT_BIAS:
            raise bad_request(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(value)}", "logit_bias")
        for key, bias in value.items():
            if not (key.isascii() and key.isdigit()):
                raise bad_request(f"logit_bias keys must be token ids (non-negative integers as strings), got {key!r}",
                                  "logit_bias")  # fmt: skip
            if not BIAS_RANGE[0] <= bias <= BIAS_RANGE[1]:
                raise bad_request(f"logit_bias values must be in [{BIAS_RANGE[0]:g}, {BIAS_RANGE[1]:g}], got {bias!r} "
                                  f"for token {key}", "logit_bias")  # fmt: skip
        return value

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as sorted (token id, bias) pairs."""
        return tuple(sorted((int(key), bias) for key, bias in (self.logit_bias or {}).items()))

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _check_prompt(value: Any) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(_is_token(t) for t in value):
            return value
        if len(value) <= MAX_PROMPTS and all(isinstance(p, str) for p in value):
            return value
        if len(value) <= MAX_PROMPTS and all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in value):
            return value
    raise bad_request(
        "prompt must be a string, a list of token ids, or a non-empty list (at most "
        f"{MAX_PROMPTS}) of strings or of token-id lists; got {_show(value)}",
        "prompt",
    )


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(description="Text, token ids, or a batch of either.")
    max_tokens: int | None = Field(default=16, ge=0, le=MAX_TOKENS_LIMIT,
                                   description="New tokens per choice; default 16. 0 only with echo: score the prompt.")
    logprobs: int | None = Field(default=None, ge=0, le=20, description="Log-probs of each token and this many alternatives.")
    echo: bool = Field(default=False, description="Prepend the prompt to the text; with logprobs, the prompt tokens' too.")
    best_of: int | None = Field(default=None, ge=1, le=MAX_N, description="Only best_of == n is supported.")
    suffix: str | None = Field(default=None, description="Not supported.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _validate_prompt(cls, value: Any) -> Any:
        return _check_prompt(value)

    @model_validator(mode="after")
    def _completion_rules(self):
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request(f"best_of must equal n ({self.n}) when given, got {self.best_of}", "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported by splitserve", "suffix", "unsupported_parameter")
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens must be at least 1 unless echo is true (0 with echo scores the prompt), "
                              "got 0", "max_tokens")  # fmt: skip
        return self


# ------------------------------------------------------------------------ chat
class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ToolCallFunction(_Strict):
    name: str
    arguments: str


class ToolCallIn(_Strict):
    """A tool call of an earlier assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


def _check_content(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        for part in value:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type")
                raise bad_request(
                    f"only text content parts are supported (type 'text' with a string 'text'), got type {kind!r}",
                    "messages.content",
                )
        return value
    raise bad_request(f"message content must be a string or a list of text parts, got {_show(value)}", "messages.content")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _validate_content(cls, value: Any) -> Any:
        return _check_content(value)

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        # as OpenAI's API: only an assistant message that calls tools may leave its content out
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a message of role {self.role!r} needs content")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT, description="Default: the rest of the context.")
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT, description="Alias of max_tokens.")
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20, description="Alternatives per token (needs logprobs).")
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description="Extra: variables for the chat template.")
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _chat_rules(self):
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise bad_request("max_tokens and max_completion_tokens differ; give one", "max_completion_tokens")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise bad_request("tool_choice needs tools", "tool_choice")
        if self.forces_tool_calls and self.json_schema is not None:
            raise bad_request("tool_choice 'required' or a named function cannot be combined with a JSON "
                              "response_format", "response_format")  # fmt: skip
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def forces_tool_calls(self) -> bool:
        """tool_choice "required" or a named function: the output is tool calls (gateway/tool_grammar.py)."""
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice))

    @property
    def forced_tool_name(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
