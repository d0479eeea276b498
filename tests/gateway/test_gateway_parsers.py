"""Tool-call, reasoning and stop-string parsers: whole-text extraction, and streamed deltas that add up to
the same result however the text is split (one character at a time included)."""

import json

import pytest

from splitserve.gateway.chat import ChatTextParser
from splitserve.gateway.reasoning_parser import ReasoningParser, extract_reasoning
from splitserve.gateway.stop_strings import StopStringMatcher, held_suffix_len
from splitserve.gateway.tool_parser import ToolCallParser, extract_tool_calls

CALLS = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], '
    '"opts": {"unit": "°C", "note": "a } in </tool_call"}}}\n</tool_call>\n'
    '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
)


def _pieces(text, size):
    return [text[i : i + size] for i in range(0, len(text), size)]


def _stream_tools(text, size):
    parser = ToolCallParser()
    content, deltas = "", []
    for piece in _pieces(text, size):
        c, d = parser.feed(piece)
        content, deltas = content + c, deltas + d
    c, d = parser.flush()
    return content + c, deltas + d, parser


def test_tool_calls_are_extracted_with_the_models_own_argument_text():
    content, calls = extract_tool_calls(CALLS)
    assert content == "Let me look.\n\n"
    assert [c.name for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0].arguments) == {
        "city": "Paris", "days": [1, 2], "opts": {"unit": "°C", "note": "a } in </tool_call"},
    }  # fmt: skip
    assert calls[0].arguments.startswith('{"city": "Paris", "days": [1, 2]')  # not re-serialized
    assert calls[1].arguments == "{}"
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13, 1000])
def test_streamed_tool_call_deltas_add_up_to_the_whole_calls(size):
    content, deltas, parser = _stream_tools(CALLS, size)
    assert content == "Let me look.\n\n"
    headers = [d for d in deltas if d.id is not None]
    assert [(d.index, d.name, d.arguments) for d in headers] == [(0, "get_weather", ""), (1, "now", "")]
    for index, call in enumerate(parser.calls):
        assert "".join(d.arguments for d in deltas if d.index == index) == call.arguments
        assert headers[index].id == call.id
    # the first delta of each call comes before any of its arguments
    first_seen = {}
    for position, d in enumerate(deltas):
        first_seen.setdefault(d.index, position)
        assert d.id is not None or position > first_seen[d.index]


def test_arguments_stream_before_the_call_is_closed():
    parser = ToolCallParser()
    _, deltas = parser.feed('<tool_call>{"name": "f", "arguments": {"query": "long te')
    assert [(d.name, d.arguments) for d in deltas] == [("f", ""), (None, '{"query": "long te')]
    _, deltas = parser.feed('xt"}}</tool_call>')
    assert [d.arguments for d in deltas] == ['xt"}']
    assert parser.calls[0].arguments == '{"query": "long text"}'


@pytest.mark.parametrize(
    "text, content",
    [
        ("no calls here", "no calls here"),
        ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after"),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>'),  # no name
        ("a < b and <tool", "a < b and <tool"),  # a held-back partial tag is released at the end
    ],
)
def test_text_that_is_not_a_call_stays_content(text, content):
    assert extract_tool_calls(text) == (content, [])
    streamed, deltas, _ = _stream_tools(text, 1)
    assert (streamed, deltas) == (content, [])


def test_unclosed_call_at_the_end_is_accepted_when_its_json_is_complete():
    content, calls = extract_tool_calls('<tool_call>{"name": "f", "arguments": {"x": 1}}')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}')]


def test_string_arguments_are_passed_through():
    _, calls = extract_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert calls[0].arguments == '{"x": 1}'


THINKING = "  <think>\nWeigh it: 2 < 3 and </thin is not a tag.\n</think>\n\nThe answer is 3."


@pytest.mark.parametrize("size", [1, 2, 4, 7, 1000])
def test_reasoning_deltas_add_up_to_the_extracted_parts(size):
    parser = ReasoningParser()
    reasoning = content = ""
    for piece in _pieces(THINKING, size):
        r, c = parser.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = parser.flush()
    assert (reasoning + r, content + c) == extract_reasoning(THINKING)
    assert extract_reasoning(THINKING) == ("\nWeigh it: 2 < 3 and </thin is not a tag.\n", "The answer is 3.")


def test_reasoning_cases():
    assert extract_reasoning("plain answer") == (None, "plain answer")
    assert extract_reasoning("<thinking is a word") == (None, "<thinking is a word")
    assert extract_reasoning("<thi") == (None, "<thi")  # cut short: released as content
    assert extract_reasoning("still thinking", starts_in_reasoning=True) == ("still thinking", "")
    assert extract_reasoning("r</think>answer", starts_in_reasoning=True) == ("r", "answer")
    assert extract_reasoning("<think>unfinished") == ("unfinished", "")


def test_chat_parser_runs_reasoning_then_tool_calls():
    text = "<think>need the weather</think>\n" + CALLS
    streamed = ChatTextParser(parses_reasoning=True, starts_in_reasoning=False, parses_tools=True)
    deltas = [streamed.feed(p) for p in _pieces(text, 3)] + [streamed.flush()]
    whole = ChatTextParser(parses_reasoning=True, starts_in_reasoning=False, parses_tools=True).message(text)
    assert whole["reasoning_content"] == "need the weather"
    assert whole["content"] == "Let me look."
    assert [c["function"]["name"] for c in whole["tool_calls"]] == ["get_weather", "now"]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "need the weather"
    assert "".join(d.get("content", "") for d in deltas).strip() == "Let me look."
    args = "".join(t["function"]["arguments"] for d in deltas for t in d.get("tool_calls", []) if t["index"] == 0)
    assert args == whole["tool_calls"][0]["function"]["arguments"]


def test_without_parsers_the_text_is_content():
    parser = ChatTextParser(parses_reasoning=False, starts_in_reasoning=False, parses_tools=False)
    assert parser.message("<think>x</think><tool_call>{}</tool_call>") == {
        "role": "assistant", "content": "<think>x</think><tool_call>{}</tool_call>",
    }  # fmt: skip


def test_stop_strings_hold_back_possible_starts_and_cut_at_the_first_match():
    matcher = StopStringMatcher(["\n\n", "END"])
    assert [matcher.feed(t) for t in ["abc\n", "x", "yEN", "D tail"]] == ["abc", "\nx", "y", ""]
    assert matcher.matched == "END" and matcher.flush() == ""
    matcher = StopStringMatcher(["###"])
    assert matcher.feed("a#") == "a" and matcher.feed("#b") == "##b" and matcher.flush() == ""
    matcher = StopStringMatcher(["stop"])
    assert matcher.feed("no sto") == "no " and matcher.flush() == "sto"
    matcher = StopStringMatcher(["ab", "b"])
    assert matcher.feed("xab") == "x" and matcher.matched == "ab"  # the earliest match wins
    assert StopStringMatcher([]).feed("anything") == "anything"
    assert held_suffix_len("xxab", ["abc", "b"]) == 2
