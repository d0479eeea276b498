"""gateway/tool_grammar.py: the grammar of forced tool calls."""

import json

import pytest

from splitserve.engine.guided import compile_lark
from splitserve.engine.tokenizer import Tokenizer
from splitserve.gateway.requests import Tool
from splitserve.gateway.tool_grammar import tool_call_grammar


def _tools(*names):
    return [Tool.model_validate({"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}) for n in names]


def test_tags_that_are_tokens_of_their_own_are_named_as_tokens(tmp_path):
    from tokenizers import AddedToken, models
    from tokenizers import Tokenizer as HFTokenizer

    plain = HFTokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    plain.save(str(tmp_path / "tokenizer.json"))
    text_tags = tool_call_grammar(_tools("f"), None, False, Tokenizer(tmp_path))
    assert '"<tool_call>"' in text_tags and '"</tool_call>"' in text_tags
    plain.add_special_tokens([AddedToken("<tool_call>", special=True), AddedToken("</tool_call>", special=True)])
    plain.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer(tmp_path)
    grammar = tool_call_grammar(_tools("f", "g"), None, True, tokenizer)
    start, end = tokenizer.token_id("<tool_call>"), tokenizer.token_id("</tool_call>")
    assert f"<[{start}]>" in grammar and f"<[{end}]>" in grammar and '"<tool_call>"' not in grammar
    schema = json.loads(grammar[grammar.index("%json") + 5 : grammar.rindex("<[")])
    assert [s["properties"]["name"]["const"] for s in schema["anyOf"]] == ["f", "g"]
    compile_lark(grammar)
    with pytest.raises(ValueError, match="names function 'h', which is not among the tools"):
        tool_call_grammar(_tools("f"), "h", False, tokenizer)
