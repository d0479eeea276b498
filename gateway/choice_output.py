"""One choice's output: router chunks in, released text and log-prob entries out.

    token ids ─▶ IncrementalDetokenizer ─▶ StopStringMatcher ─▶ text delta
             └─▶ log-prob entries (token text, log-prob, top alternatives)

The chat and completions handlers add their own parsing (reasoning, tool
calls) on top of the text deltas.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.client import FinishReason, StreamChunk, Usage
from splitserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from splitserve.gateway.stop_strings import StopStringMatcher

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}


class TokenTexts:
    """Each token id's own text (for log-probs), cached: the same ids come back all the time."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def in_text(self, token_id: int) -> bool:
        """Whether the token's text is part of the decoded text (special tokens are left out)."""
        return token_id not in self._tokenizer.special_ids

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float | None
    """None only for a prompt's first token (nothing before it)."""
    top: tuple[tuple[str, float], ...] | None
    """Alternatives (token text, log-prob), most likely first; None with `logprob`."""
    in_text: bool = True
    """False for a special token (BOS, EOS): the decoded text leaves it out, so it takes no
    characters of `text_offset`."""


@dataclass
class ChoiceDelta:
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    """The prompt's entries (echo with logprobs), on the first token's delta."""


class ChoiceOutput:
    """Per-choice state; not thread-safe."""

    def __init__(
        self, tokenizer: Tokenizer, token_texts: TokenTexts, prompt_ids: list[int], stop: tuple[str, ...],
        wants_logprobs: bool,
    ) -> None:  # fmt: skip
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._token_texts = token_texts
        self._stops = StopStringMatcher(stop)
        self._wants_logprobs = wants_logprobs
        self._prompt_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.text = ""
        """Everything released so far."""
        self.num_tokens = 0
        """Tokens received (those after a stop string included)."""
        self.finish_reason: str | None = None
        self.usage: Usage | None = None

    @property
    def is_stopped_by_string(self) -> bool:
        return self._stops.matched is not None

    def add(self, chunk: StreamChunk) -> ChoiceDelta:
        delta = ChoiceDelta()
        if chunk.prompt_log_probs is not None:
            delta.prompt_logprobs = self._prompt_entries(chunk)
        self.num_tokens += len(chunk.token_ids)
        for i, token_id in enumerate(chunk.token_ids):
            if self._stops.matched is not None:
                break
            delta.text += self._stops.feed(self._detokenizer.add(token_id))
            if self._wants_logprobs and i < len(chunk.logprobs):
                delta.logprobs.append(self._entry(token_id, chunk, i))
        if chunk.result is not None:
            self.usage = chunk.result.usage
            self.finish_reason = _FINISH[chunk.result.finish_reason]
            delta.text += self._stops.flush()
        if self._stops.matched is not None:
            self.finish_reason = "stop"
        self.text += delta.text
        return delta

    def finish_early(self) -> None:
        """A stop string ended the output but the worker went on: stop reading (the stream is cancelled)."""
        self.finish_reason = "stop"
        self.usage = Usage(self.num_prompt_tokens, self.num_tokens, 0)

    def _entry(self, token_id: int, chunk: StreamChunk, i: int) -> TokenLogprob:
        top = chunk.top_logprobs[i] if i < len(chunk.top_logprobs) else {}
        return TokenLogprob(self._token_texts(token_id), chunk.logprobs[i], self._alternatives(top),
                            self._token_texts.in_text(token_id))

    def _alternatives(self, top) -> tuple[tuple[str, float], ...]:
        return tuple((self._token_texts(t), lp) for t, lp in sorted(top.items(), key=lambda kv: -kv[1]))

    def _prompt_entries(self, chunk: StreamChunk) -> list[TokenLogprob]:
        """The prompt tokens' entries: the first has no log-prob (OpenAI's null), each later one
        its log-prob given those before it, and its alternatives when asked for."""
        ids, lps, tops = self._prompt_ids, chunk.prompt_log_probs, chunk.prompt_top_logprobs
        texts = self._token_texts
        entries = [TokenLogprob(texts(ids[0]), None, None, texts.in_text(ids[0]))] if ids else []
        for i, token_id in enumerate(ids[1:]):
            top = tops[i] if i < len(tops) else {}
            entries.append(TokenLogprob(texts(token_id), lps[i] if i < len(lps) else None, self._alternatives(top),
                                        texts.in_text(token_id)))  # fmt: skip
        return entries
