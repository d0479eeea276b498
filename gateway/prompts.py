"""From a validated request to token ids: tokenization, the chat template, and the context-length check."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.gateway.errors import APIError, bad_request
from splitserve.gateway.model_info import ModelInfo
from splitserve.gateway.requests import ChatCompletionRequest, CompletionRequest

THINK_START = "<think>"


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str | None
    """The prompt's text (None for token-id prompts until decoded), for `echo`."""


def completion_prompts(request: CompletionRequest, model: ModelInfo) -> list[Prompt]:
    """One Prompt per entry of `prompt` (a batch), each checked against the vocabulary and context."""
    _check_logit_bias(request, model)
    raw = request.prompt
    items = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else raw
    prompts = []
    for item in items:
        if isinstance(item, str):
            prompts.append(Prompt(model.tokenizer.encode(item, add_bos=True), item))
        else:
            _check_token_ids(item, model)
            prompts.append(Prompt(list(item), None))
    for prompt in prompts:
        if not prompt.token_ids:
            raise bad_request("the prompt is empty (no tokens)", "prompt")
    return prompts


def chat_prompt(request: ChatCompletionRequest, model: ModelInfo) -> tuple[Prompt, str]:
    """The rendered conversation's tokens, and the rendered text (the reasoning parser reads its end)."""
    _check_logit_bias(request, model)
    messages = [_message_dict(m) for m in request.messages]
    extra = dict(request.chat_template_kwargs or {})
    if request.tools:
        extra["tools"] = [tool.model_dump(exclude_none=True) for tool in request.tools]
    for reserved in ("messages", "add_generation_prompt", "bos_token", "eos_token"):
        if reserved in extra:
            raise bad_request(f"chat_template_kwargs may not set {reserved!r}", "chat_template_kwargs")
    if not model.tokenizer.chat_template:
        raise bad_request(
            f"model {model.name!r} has no chat template in its tokenizer_config.json; use /v1/completions", "messages"
        )
    try:
        text = model.tokenizer.apply_chat_template(messages, add_generation_prompt=request.add_generation_prompt, **extra)
    except Exception as e:  # noqa: BLE001 - jinja errors of every kind are the conversation's fault
        raise bad_request(f"the model's chat template rejected the messages: {type(e).__name__}: {e}", "messages") from None
    ids = model.tokenizer.encode(text, add_bos=False)  # the template writes BOS itself when the model wants one
    if not ids:
        raise bad_request("the rendered conversation is empty (no tokens)", "messages")
    return Prompt(ids, text), text


def max_new_tokens(requested: int | None, prompt_len: int, model: ModelInfo, what: str) -> int:
    """The token budget of one choice; 400 when prompt + budget exceed the context (OpenAI's wording)."""
    context = model.max_model_len
    if requested is None:
        if prompt_len >= context:
            raise _context_error(
                f"This model's maximum context length is {context} tokens. However, your {what} resulted in "
                f"{prompt_len} tokens, which leaves no room for a completion. Please reduce the length of the {what}."
            )
        return context - prompt_len
    if prompt_len + requested > context:
        raise _context_error(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the {what}, {requested} in the completion). "
            f"Please reduce the length of the {what} or completion."
        )
    return requested


def starts_in_reasoning(rendered_prompt: str) -> bool:
    """The template opened a <think> block itself (R1-style), so the output begins inside it."""
    return rendered_prompt.rstrip().endswith(THINK_START)


def _check_token_ids(ids: list[int], model: ModelInfo) -> None:
    bad = next((t for t in ids if not 0 <= t < model.vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is out of the vocabulary [0, {model.vocab_size})", "prompt")


def _check_logit_bias(request: CompletionRequest | ChatCompletionRequest, model: ModelInfo) -> None:
    bad = next((t for t, _ in request.logit_bias_pairs if t >= model.vocab_size), None)
    if bad is not None:
        raise bad_request(f"logit_bias token id {bad} is out of the vocabulary [0, {model.vocab_size})", "logit_bias")


def _context_error(message: str) -> APIError:
    return bad_request(message, "messages" if "messages" in message else "prompt", "context_length_exceeded")


def _message_dict(message) -> dict:
    out: dict = {"role": message.role, "content": message.text}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None:
        out["reasoning_content"] = message.reasoning_content
    return out
