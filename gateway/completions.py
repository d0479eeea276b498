"""POST /v1/completions: prompts (text or token ids, batched) × n choices, streamed or whole.

Each choice is one router request (`<id>-<choice index>`); choice index
= prompt index × n + choice number, as OpenAI numbers them.

`echo` with `logprobs` returns the prompt tokens' log-probs before the generated ones (the
first prompt token's is null), computed by the worker that computes the prompt; `max_tokens: 0`
with `echo` scores the prompt alone, as evaluation harnesses ask (one token is generated and
dropped: the engine samples at the prompt's end anyway). `response_format` is taken here as on
chat (an extension of OpenAI's completions, as vLLM's): the output follows the JSON schema.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from splitserve.client import SamplingParams
from splitserve.gateway.choice_output import ChoiceDelta, ChoiceOutput, TokenLogprob
from splitserve.gateway.context import ServingContext
from splitserve.gateway.errors import bad_request
from splitserve.gateway.generation import merge, run_choice
from splitserve.gateway.prompts import completion_prompts, max_new_tokens
from splitserve.gateway.requests import CompletionRequest
from splitserve.gateway.responses import completion_logprobs, echoed_logprobs, now, total_usage, usage_dict
from splitserve.gateway.sampling import choice_params, stop_strings

MAX_PROMPT_LOGPROB_ENTRIES = 1_000_000
"""Prompt log-probs (one per token and alternative) one prompt may ask for: ~13 bytes each on the
wire, so the worker's first message stays under the 16 MiB gRPC message limit."""


@dataclass
class _Choice:
    index: int
    prompt_index: int
    prompt_ids: list[int]
    echo: str
    """Prompt text put before the output (echo), else ""."""
    params: SamplingParams
    output: ChoiceOutput
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    """echo with logprobs: the prompt tokens' entries."""
    offset: int = 0
    """Characters of this choice's text sent so far (text_offset of the next token)."""


class CompletionRun:
    """One validated completion request, ready to run. Building it does all the checks (APIError)."""

    endpoint = "completions"

    def __init__(self, request: CompletionRequest, ctx: ServingContext) -> None:
        self.request = request
        self.ctx = ctx
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = now()
        prompts = completion_prompts(request, ctx.model)
        self.prompt_lens = [len(p.token_ids) for p in prompts]
        wants_logprobs = request.logprobs is not None
        stops = stop_strings(request.stop)
        self.choices: list[_Choice] = []
        self.score_only = request.max_tokens == 0
        """max_tokens 0 (echo): the prompt alone; the one token generated is dropped."""
        if wants_logprobs and request.echo:
            longest = max(len(p.token_ids) for p in prompts)
            entries = longest * (1 + (request.logprobs or 0))
            if entries > MAX_PROMPT_LOGPROB_ENTRIES:
                raise bad_request(
                    f"echo with logprobs={request.logprobs} on a {longest}-token prompt "
                    f"asks for {entries:,} log-probs, more than the {MAX_PROMPT_LOGPROB_ENTRIES:,} one answer carries; "
                    "ask fewer alternatives or split the prompt", "logprobs")  # fmt: skip
        for p, prompt in enumerate(prompts):
            budget = max_new_tokens(1 if self.score_only else request.max_tokens,
                                    len(prompt.token_ids), ctx.model, "prompt")  # fmt: skip
            echo = ""
            if request.echo:
                echo = prompt.text if prompt.text is not None else ctx.model.tokenizer.decode(prompt.token_ids)
            for i in range(request.n):
                params = choice_params(
                    request, budget, i, return_log_probs=wants_logprobs, top_n_logprobs=request.logprobs or 0,
                    return_prompt_log_probs=wants_logprobs and request.echo, json_schema=request.json_schema,
                )
                output = ChoiceOutput(ctx.model.tokenizer, ctx.token_texts, prompt.token_ids, stops, wants_logprobs)
                self.choices.append(_Choice(p * request.n + i, p, prompt.token_ids, echo, params, output))

    # -------------------------------------------------------------------- runs
    def _stream_choice(self, choice: _Choice):
        return run_choice(self.ctx.client, f"{self.id}-{choice.index}", choice.prompt_ids, choice.params, choice.output)

    async def _tagged(self, choice: _Choice) -> AsyncIterator[tuple[_Choice, object]]:
        async for delta in self._stream_choice(choice):
            yield choice, delta
        yield choice, None  # the end of this choice

    async def response(self) -> dict:
        """The whole answer (non-streaming)."""
        async for choice, delta in merge([self._tagged(c) for c in self.choices]):
            if delta is not None:
                choice.logprobs += self._generated(delta).logprobs
                choice.prompt_logprobs += delta.prompt_logprobs or []
        return {
            "id": self.id, "object": "text_completion", "created": self.created, "model": self.ctx.model.name,
            "choices": [self._final_choice(c) for c in self.choices], "usage": self.usage(),
        }  # fmt: skip

    async def events(self) -> AsyncIterator[dict]:
        """The streamed chunks (SSE payloads), the usage chunk last when asked for."""
        include_usage = self.request.include_usage
        async for choice, delta in merge([self._tagged(c) for c in self.choices]):
            if delta is None:
                text = choice.echo if choice.offset == 0 else ""  # echo of a choice that produced no text
                yield self._chunk(choice, text, None, self._finish_reason(choice), include_usage)
                continue
            delta = self._generated(delta)
            text = delta.text
            if choice.echo and choice.offset == 0:
                text = choice.echo + text
            logprobs = None
            if self._wants_logprobs:
                if delta.prompt_logprobs is not None:  # with the echo (the first token's delta)
                    logprobs = echoed_logprobs(delta.prompt_logprobs, delta.logprobs, len(choice.echo))
                else:
                    logprobs = completion_logprobs(delta.logprobs, choice.offset + len(text) - len(delta.text))
            choice.offset += len(text)
            yield self._chunk(choice, text, logprobs, None, include_usage)
        if include_usage:
            yield {
                "id": self.id, "object": "text_completion", "created": self.created, "model": self.ctx.model.name,
                "choices": [], "usage": self.usage(),
            }  # fmt: skip

    def usage(self) -> dict:
        n = self.request.n
        per_prompt = [[c.output.usage for c in self.choices[p * n : (p + 1) * n]] for p in range(len(self.prompt_lens))]
        if any(u is None for usages in per_prompt for u in usages):  # cut short: count what arrived
            completion = 0 if self.score_only else sum(c.output.num_tokens for c in self.choices)
            return usage_dict(sum(self.prompt_lens), completion, 0)
        if self.score_only:  # the dropped token is not output
            per_prompt = [[replace(u, completion_tokens=0) for u in usages] for usages in per_prompt]
        return total_usage(self.prompt_lens, per_prompt)

    def _finish_reason(self, choice: _Choice) -> str | None:
        return "length" if self.score_only else choice.output.finish_reason  # scoring: the budget was 0

    def _generated(self, delta: ChoiceDelta) -> ChoiceDelta:
        """The delta as the client sees it: with max_tokens 0, no generated text or entries."""
        return ChoiceDelta("", [], delta.prompt_logprobs) if self.score_only else delta

    # ----------------------------------------------------------------- shapes
    @property
    def _wants_logprobs(self) -> bool:
        return self.request.logprobs is not None

    def _final_choice(self, choice: _Choice) -> dict:
        text = choice.echo + ("" if self.score_only else choice.output.text)
        logprobs = None
        if self._wants_logprobs:
            logprobs = echoed_logprobs(choice.prompt_logprobs, choice.logprobs, len(choice.echo))
        return {
            "index": choice.index, "text": text, "logprobs": logprobs,
            "finish_reason": self._finish_reason(choice),
        }  # fmt: skip

    def _chunk(self, choice: _Choice, text: str, logprobs, finish_reason, include_usage: bool) -> dict:
        chunk = {
            "id": self.id, "object": "text_completion", "created": self.created, "model": self.ctx.model.name,
            "choices": [{"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
        }  # fmt: skip
        if include_usage:
            chunk["usage"] = None
        return chunk
