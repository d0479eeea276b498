"""`<think>…</think>` reasoning, split from the answer (OpenAI-compatible `reasoning_content`).

The output is reasoning when it opens with `<think>` (leading whitespace
allowed) or when the prompt already opened the block (R1-style templates:
`starts_in_reasoning`); reasoning ends at `</think>`, and the answer's leading
whitespace is dropped. Text that may be the start of a tag is held back while
streaming, so a tag split across tokens never leaks into either part.
Non-streaming extraction runs the same state machine over the whole text, so
the streamed deltas always add up to the non-streamed message.
"""

from __future__ import annotations

from splitserve.gateway.stop_strings import held_suffix_len

START = "<think>"
END = "</think>"


class ReasoningParser:
    """Per-choice state machine: `feed` text deltas, `flush` at the end; each returns (reasoning, content)."""

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self._state = "reasoning" if starts_in_reasoning else "start"
        self._buffer = ""
        self._strip_leading = False
        self.has_reasoning = starts_in_reasoning
        """A reasoning block was opened."""

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        reasoning = ""
        if self._state == "start":
            stripped = self._buffer.lstrip()
            if stripped.startswith(START):
                self._state, self._buffer, self.has_reasoning = "reasoning", stripped[len(START) :], True
            elif START.startswith(stripped):
                return "", ""  # still undecided: "", "  ", "<th"
            else:
                self._state = "content"
        if self._state == "reasoning":
            at = self._buffer.find(END)
            if at == -1:
                keep = held_suffix_len(self._buffer, (END,))
                cut = len(self._buffer) - keep
                reasoning, self._buffer = self._buffer[:cut], self._buffer[cut:]
                return reasoning, ""
            reasoning = self._buffer[:at]
            self._buffer = self._buffer[at + len(END) :]
            self._state, self._strip_leading = "content", True
        return reasoning, self._content()

    def flush(self) -> tuple[str, str]:
        rest, self._buffer = self._buffer, ""
        if self._state == "reasoning":
            return rest, ""
        return "", rest.lstrip() if self._strip_leading else rest

    def _content(self) -> str:
        text, self._buffer = self._buffer, ""
        if self._strip_leading:
            text = text.lstrip()
            if text:
                self._strip_leading = False
        return text


def extract_reasoning(text: str, starts_in_reasoning: bool = False) -> tuple[str | None, str]:
    """(reasoning or None when there was no reasoning block, the answer)."""
    parser = ReasoningParser(starts_in_reasoning)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.flush()
    return (r1 + r2 if parser.has_reasoning else None), c1 + c2
