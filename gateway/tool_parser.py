"""Tool calls written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes / Qwen style).

Streaming emits OpenAI's incremental `tool_calls` deltas: the first delta of a
call carries its index, id and name as soon as the name is complete, then the
`arguments` JSON text arrives piece by piece as the model writes it. The
arguments text is the model's own JSON (sliced from the output, not
re-serialized), so the streamed pieces add up to exactly the non-streamed
`arguments`; `extract_tool_calls` runs the same state machine over the whole
text. A block that is not valid JSON with a string "name" stays content (or,
when its name was already streamed, ends with what was sent).

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>
               └─ header delta once `"name": "get_weather"` is complete
                                                    └─ arguments deltas: {"city": "Pa | ris"}
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass, field

from splitserve.gateway.stop_strings import held_suffix_len

log = logging.getLogger(__name__)

START = "<tool_call>"
END = "</tool_call>"
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')
_DECODER = json.JSONDecoder()


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """JSON text of the arguments object."""


@dataclass(frozen=True)
class ToolCallDelta:
    """One piece of OpenAI's streamed `tool_calls[i]`."""

    index: int
    id: str | None = None
    """Set on the call's first delta only, with `name`."""
    name: str | None = None
    arguments: str = ""


@dataclass
class _Call:
    index: int
    id: str
    is_announced: bool = False
    arguments_sent: str = ""
    is_arguments_done: bool = False


@dataclass
class ToolCallParser:
    """Per-choice state machine: `feed` text deltas, `flush` at the end; each returns (content, deltas)."""

    calls: list[ToolCall] = field(default_factory=list)
    """The complete, valid calls so far."""
    _state: str = "content"
    _buffer: str = ""
    _call: _Call | None = None
    _num_started: int = 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buffer += text
        content, deltas = "", []
        while True:
            if self._state == "content":
                at = self._buffer.find(START)
                if at == -1:
                    cut = len(self._buffer) - held_suffix_len(self._buffer, (START,))
                    content += self._buffer[:cut]
                    self._buffer = self._buffer[cut:]
                    return content, deltas
                content += self._buffer[:at]
                self._buffer = self._buffer[at + len(START) :]
                self._state = "call"
                self._call = _Call(self._num_started, new_call_id())
            at = self._buffer.find(END)
            if at == -1:
                deltas += self._progress(self._buffer)
                return content, deltas
            body, self._buffer = self._buffer[:at], self._buffer[at + len(END) :]
            more_content, more_deltas = self._finish(body)
            content += more_content
            deltas += more_deltas
            self._state = "content"

    def flush(self) -> tuple[str, list[ToolCallDelta]]:
        """At the end of the output: an unclosed call is accepted if its JSON is complete."""
        rest, self._buffer = self._buffer, ""
        if self._state == "content":
            return rest, []
        self._state = "content"
        return self._finish(rest)

    # ------------------------------------------------------------------ steps
    def _progress(self, body: str) -> list[ToolCallDelta]:
        call, deltas = self._call, []
        if not call.is_announced:
            match = _NAME.match(body)
            name = _json_string(match.group(1)) if match else None
            if name is None:
                return deltas
            deltas.append(self._announce(call, name))
        if call.is_arguments_done:
            return deltas
        match = _ARGUMENTS.search(body)
        if match is None or match.end() >= len(body) or body[match.end()] != "{":
            return deltas  # not there yet, or not an object: sent whole at the end
        start = match.end()
        try:
            _, end = _DECODER.raw_decode(body, start)
            text, call.is_arguments_done = body[start:end], True
        except json.JSONDecodeError:
            text = body[start:]  # an unfinished object: all of it belongs to the arguments
        if text.startswith(call.arguments_sent) and len(text) > len(call.arguments_sent):
            deltas.append(ToolCallDelta(call.index, arguments=text[len(call.arguments_sent) :]))
            call.arguments_sent = text
        return deltas

    def _finish(self, body: str) -> tuple[str, list[ToolCallDelta]]:
        call, self._call = self._call, None
        parsed = _parse_call(body)
        if parsed is None:
            if not call.is_announced:
                return START + body + END, []
            log.warning("tool call %s: its name was streamed but its JSON is invalid: %r", call.id, body[:200])
            return "", []
        name, arguments = parsed
        deltas = [] if call.is_announced else [self._announce(call, name)]
        if arguments.startswith(call.arguments_sent) and len(arguments) > len(call.arguments_sent):
            deltas.append(ToolCallDelta(call.index, arguments=arguments[len(call.arguments_sent) :]))
        self.calls.append(ToolCall(call.id, name, arguments))
        return "", deltas

    def _announce(self, call: _Call, name: str) -> ToolCallDelta:
        call.is_announced = True
        self._num_started += 1
        return ToolCallDelta(call.index, id=call.id, name=name, arguments="")


def _parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a call body, or None when it is not a call."""
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return value["name"], arguments
    match = _ARGUMENTS.search(body)
    if match is not None and isinstance(arguments, dict) and body[match.end() : match.end() + 1] == "{":
        try:
            _, end = _DECODER.raw_decode(body, match.end())
            return value["name"], body[match.end() : end]
        except json.JSONDecodeError:
            pass
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def _json_string(escaped: str) -> str | None:
    try:
        return json.loads(f'"{escaped}"')
    except json.JSONDecodeError:
        return None


def extract_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(the content outside the calls, the calls) of a whole output."""
    parser = ToolCallParser()
    content, _ = parser.feed(text)
    rest, _ = parser.flush()
    return content + rest, parser.calls
