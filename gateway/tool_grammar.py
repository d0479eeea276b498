"""`tool_choice: "required"` or a named function: the output forced to tool calls, by a grammar.

The gateway's tool parser reads Hermes-style calls (tool_parser.py), so the grammar is that text
with each call's JSON held to its tool's schema (llguidance's Lark, `%json` embedding a JSON
schema; engine/guided.py samples under it):

    start: call ("\\n" call)*          one call or more ("required"; one only without
    call:  "<tool_call>" %json {...} "</tool_call>"     parallel_tool_calls or for a named function)

where the schema is `{"name": <const>, "arguments": <the tool's parameters>}`, one of the tools'
for "required". When the tokenizer has `<tool_call>` / `</tool_call>` as tokens of their own (Qwen's
added tokens), the grammar names those tokens (`<[id]>`), so the model writes them as it was
trained to rather than spelling them out.
"""

from __future__ import annotations

import json

from splitserve.engine.guided import JSON_LAYOUT
from splitserve.engine.tokenizer import Tokenizer
from splitserve.gateway.tool_parser import END, START


def _call_schema(tool) -> dict:
    params = tool.function.parameters or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}  # fmt: skip


def _literal(text: str, tokenizer: Tokenizer) -> str:
    token = tokenizer.token_id(text)
    return f"<[{token}]>" if token is not None else json.dumps(text)


def tool_call_grammar(tools, name: str | None, parallel: bool, tokenizer: Tokenizer) -> str:
    """The Lark grammar of forced calls to `tools` (only `name` when given; several calls in a row
    when `parallel` and no name). Raises ValueError when `name` is not one of `tools`."""
    chosen = [t for t in tools if name is None or t.function.name == name]
    if not chosen:
        raise ValueError(f"tool_choice names function {name!r}, which is not among the tools "
                         f"({', '.join(t.function.name for t in tools)})")  # fmt: skip
    schemas = [_call_schema(t) for t in chosen]
    schema = {**(schemas[0] if len(schemas) == 1 else {"anyOf": schemas}), "x-guidance": JSON_LAYOUT}
    repeat = ' ("\\n" call)*' if parallel and name is None else ""
    return (f"start: call{repeat}\n"
            f"call: {_literal(START, tokenizer)} %json {json.dumps(schema)} {_literal(END, tokenizer)}\n")  # fmt: skip
