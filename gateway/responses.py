"""OpenAI response pieces as plain dicts (the JSON the clients parse)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from splitserve.client import Usage
from splitserve.gateway.choice_output import TokenLogprob
from splitserve.gateway.tool_parser import ToolCall, ToolCallDelta


def now() -> int:
    return int(time.time())


def usage_dict(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> dict:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def total_usage(prompt_lens: Sequence[int], choice_usages: Sequence[Sequence[Usage | None]]) -> dict:
    """Prompts count once however many choices they have; cached tokens are those of each prompt's first choice."""
    completion = sum(u.completion_tokens for usages in choice_usages for u in usages if u is not None)
    cached = sum(usages[0].cached_tokens for usages in choice_usages if usages and usages[0] is not None)
    return usage_dict(sum(prompt_lens), completion, cached)


def completion_logprobs(entries: Sequence[TokenLogprob], first_offset: int) -> dict:
    """The legacy completions shape: parallel lists, `text_offset` into the choice's text (a
    special token, which the text leaves out, takes no characters of it)."""
    offsets, offset = [], first_offset
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token) if entry.in_text else 0
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [None if e.top is None else dict(e.top) for e in entries],
        "text_offset": offsets,
    }


def echoed_logprobs(prompt: Sequence[TokenLogprob], generated: Sequence[TokenLogprob], echo_len: int) -> dict:
    """`completion_logprobs` of an echoed prompt's entries (offsets from 0) then the generated ones
    (offsets from the end of the echoed text)."""
    head, tail = completion_logprobs(prompt, 0), completion_logprobs(generated, echo_len)
    return {key: head[key] + tail[key] for key in head}


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict:
    return {
        "content": [
            {
                "token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode("utf-8")),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))} for t, lp in e.top],
            }  # fmt: skip
            for e in entries
        ],
        "refusal": None,
    }


def tool_call_dict(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_delta_dict(delta: ToolCallDelta) -> dict:
    out: dict = {"index": delta.index}
    if delta.id is not None:
        out["id"] = delta.id
        out["type"] = "function"
        out["function"] = {"name": delta.name, "arguments": delta.arguments}
    else:
        out["function"] = {"arguments": delta.arguments}
    return out


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
