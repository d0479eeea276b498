"""POST /v1/chat/completions: the chat template, n choices, reasoning and tool-call parsing, streamed or whole.

Text of a choice flows: detokenizer → stop strings → reasoning parser
(`reasoning_content`) → tool-call parser (`tool_calls`) → `content`. The
streamed deltas and the whole message come from the same state machines, so
they always agree.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from splitserve.client import SamplingParams
from splitserve.engine.guided import compile_lark
from splitserve.gateway.choice_output import ChoiceOutput, TokenLogprob
from splitserve.gateway.context import ServingContext
from splitserve.gateway.errors import bad_request
from splitserve.gateway.generation import merge, run_choice
from splitserve.gateway.prompts import chat_prompt, max_new_tokens, starts_in_reasoning
from splitserve.gateway.reasoning_parser import ReasoningParser
from splitserve.gateway.requests import ChatCompletionRequest
from splitserve.gateway.responses import (
    chat_logprobs,
    now,
    tool_call_delta_dict,
    tool_call_dict,
    total_usage,
    usage_dict,
)
from splitserve.gateway.sampling import choice_params, stop_strings
from splitserve.gateway.tool_grammar import tool_call_grammar
from splitserve.gateway.tool_parser import ToolCallParser


class ChatTextParser:
    """Splits one choice's text into reasoning, content and tool calls; `feed` deltas, then `flush`."""

    def __init__(self, *, parses_reasoning: bool, starts_in_reasoning: bool, parses_tools: bool) -> None:
        self._reasoning = ReasoningParser(starts_in_reasoning) if parses_reasoning else None
        self._tools = ToolCallParser() if parses_tools else None

    @property
    def has_tool_calls(self) -> bool:
        return self._tools is not None and bool(self._tools.calls)

    def feed(self, text: str) -> dict:
        reasoning, content = self._reasoning.feed(text) if self._reasoning else ("", text)
        return self._delta(reasoning, *self._feed_tools(content))

    def flush(self) -> dict:
        reasoning, content = self._reasoning.flush() if self._reasoning else ("", "")
        content, deltas = self._feed_tools(content)
        if self._tools is not None:
            rest, more = self._tools.flush()
            content, deltas = content + rest, deltas + more
        return self._delta(reasoning, content, deltas)

    def message(self, text: str) -> dict:
        """The whole message of a finished choice (run on a fresh parser)."""
        delta = self.feed(text)
        rest = self.flush()
        reasoning = delta.get("reasoning_content", "") + rest.get("reasoning_content", "")
        content = delta.get("content", "") + rest.get("content", "")
        message: dict = {"role": "assistant", "content": content}
        if self._reasoning is not None and self._reasoning.has_reasoning:
            message["reasoning_content"] = reasoning
        if self.has_tool_calls:
            message["content"] = content.strip() or None
            message["tool_calls"] = [tool_call_dict(call) for call in self._tools.calls]
        return message

    def _feed_tools(self, content: str):
        if self._tools is None or not content:
            return content, []
        return self._tools.feed(content)

    @staticmethod
    def _delta(reasoning: str, content: str, tool_deltas) -> dict:
        delta: dict = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if tool_deltas:
            delta["tool_calls"] = [tool_call_delta_dict(d) for d in tool_deltas]
        return delta


@dataclass
class _Choice:
    index: int
    params: SamplingParams
    output: ChoiceOutput
    parser: ChatTextParser
    logprobs: list[TokenLogprob] = field(default_factory=list)
    has_started: bool = False
    """The role chunk was sent."""


class ChatRun:
    """One validated chat request, ready to run. Building it does all the checks (APIError)."""

    endpoint = "chat_completions"

    def __init__(self, request: ChatCompletionRequest, ctx: ServingContext) -> None:
        self.request = request
        self.ctx = ctx
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = now()
        prompt, rendered = chat_prompt(request, ctx.model)
        self.prompt_ids = prompt.token_ids
        budget = max_new_tokens(request.max_new_tokens, len(prompt.token_ids), ctx.model, "messages")
        self._parser_options = dict(
            parses_reasoning=ctx.config.reasoning_parser == "think",
            starts_in_reasoning=ctx.config.reasoning_parser == "think" and starts_in_reasoning(rendered),
            parses_tools=ctx.config.tool_call_parser == "hermes" and request.parses_tool_calls,
        )
        stops = stop_strings(request.stop)
        grammar = self._tool_grammar(request, ctx)
        self.choices = [
            _Choice(
                i,
                choice_params(request, budget, i, return_log_probs=request.logprobs,
                              top_n_logprobs=request.top_logprobs or 0, json_schema=request.json_schema,
                              grammar=grammar),
                ChoiceOutput(ctx.model.tokenizer, ctx.token_texts, prompt.token_ids, stops, request.logprobs),
                ChatTextParser(**self._parser_options),
            )  # fmt: skip
            for i in range(request.n)
        ]

    @staticmethod
    def _tool_grammar(request: ChatCompletionRequest, ctx: ServingContext) -> str | None:
        """The grammar of forced tool calls (tool_choice "required" / a named function), else None."""
        if not request.forces_tool_calls:
            return None
        if ctx.config.tool_call_parser != "hermes":
            raise bad_request("tool_choice 'required' or a named function needs the gateway's tool-call parser "
                              "(--tool-call-parser hermes)", "tool_choice")  # fmt: skip
        try:
            grammar = tool_call_grammar(request.tools, request.forced_tool_name, request.parallel_tool_calls is not False,
                                        ctx.model.tokenizer)  # fmt: skip
            compile_lark(grammar)
        except ValueError as exc:
            raise bad_request(str(exc), "tool_choice") from None
        return grammar

    async def _tagged(self, choice: _Choice) -> AsyncIterator[tuple[_Choice, object]]:
        stream = run_choice(self.ctx.client, f"{self.id}-{choice.index}", self.prompt_ids, choice.params, choice.output)
        async for delta in stream:
            yield choice, delta
        yield choice, None

    async def response(self) -> dict:
        async for choice, delta in merge([self._tagged(c) for c in self.choices]):
            if delta is not None:
                choice.logprobs += delta.logprobs
        return {
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.ctx.model.name,
            "choices": [self._final_choice(c) for c in self.choices], "usage": self.usage(),
        }  # fmt: skip

    async def events(self) -> AsyncIterator[dict]:
        include_usage = self.request.include_usage
        async for choice, delta in merge([self._tagged(c) for c in self.choices]):
            if not choice.has_started:
                choice.has_started = True
                yield self._chunk(choice, {"role": "assistant", "content": ""}, None, None, include_usage)
            if delta is None:
                rest = choice.parser.flush()
                if rest:
                    yield self._chunk(choice, rest, None, None, include_usage)
                yield self._chunk(choice, {}, None, self._finish_reason(choice, choice.parser), include_usage)
                continue
            parsed = choice.parser.feed(delta.text)
            logprobs = chat_logprobs(delta.logprobs) if self.request.logprobs and delta.logprobs else None
            if parsed or logprobs:
                yield self._chunk(choice, parsed, logprobs, None, include_usage)
        if include_usage:
            yield {
                "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.ctx.model.name, "choices": [], "usage": self.usage(),
            }  # fmt: skip

    def usage(self) -> dict:
        usages = [c.output.usage for c in self.choices]
        if any(u is None for u in usages):
            return usage_dict(len(self.prompt_ids), sum(c.output.num_tokens for c in self.choices), 0)
        return total_usage([len(self.prompt_ids)], [usages])

    def _final_choice(self, choice: _Choice) -> dict:
        parser = ChatTextParser(**self._parser_options)
        message = parser.message(choice.output.text)
        return {
            "index": choice.index, "message": message,
            "logprobs": chat_logprobs(choice.logprobs) if self.request.logprobs else None,
            "finish_reason": self._finish_reason(choice, parser),
        }  # fmt: skip

    @staticmethod
    def _finish_reason(choice: _Choice, parser: ChatTextParser) -> str | None:
        reason = choice.output.finish_reason
        return "tool_calls" if reason == "stop" and parser.has_tool_calls else reason

    def _chunk(self, choice: _Choice, delta: dict, logprobs, finish_reason, include_usage: bool) -> dict:
        chunk = {
            "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.ctx.model.name,
            "choices": [{"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
        }  # fmt: skip
        if include_usage:
            chunk["usage"] = None
        return chunk
