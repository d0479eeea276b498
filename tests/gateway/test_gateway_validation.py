"""Every bad request gets a 4xx in OpenAI's error shape with a message that says what is wrong — never a
500, never a hang — and the router never sees it."""

import json
import socket
import time
from urllib.parse import urlsplit

import pytest

from tests.gateway.conftest import MODEL
from tests.gateway.http_helpers import post, request

CHAT = "/v1/chat/completions"
DONE = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]

CASES = [
    # (path, body, status, words the message must contain)
    (DONE, b"{bad json", 400, "not valid JSON"),
    (DONE, b"", 400, "empty"),
    (DONE, b"[1, 2]", 400, "must be a JSON object, got a JSON array"),
    (DONE, b'"prompt"', 400, "must be a JSON object, got a JSON string"),
    (DONE, b"null", 400, "must be a JSON object, got a JSON null"),
    (DONE, b'{"prompt": "\xff\xfe"}', 400, "not valid UTF-8"),
    (DONE, b'{"prompt": "a\\ud800b"}', 400, "lone surrogate"),
    (DONE, b'{"prompt": "a", "temperature": NaN}', 400, "NaN is not a JSON number"),
    (DONE, b'{"prompt": "a", "temperature": Infinity}', 400, "Infinity"),
    (DONE, b'{"prompt": "a", "temperature": 1e999}', 400, "temperature"),
    (DONE, b"[" * 20000 + b"]" * 20000, 400, "nested too deeply"),
    (DONE, {}, 400, "prompt is required"),
    (DONE, {"prompt": 5}, 400, "prompt must be a string"),
    (DONE, {"prompt": []}, 400, "prompt must be"),
    (DONE, {"prompt": [1, "a"]}, 400, "prompt must be"),
    (DONE, {"prompt": [[1, 2], []]}, 400, "prompt must be"),
    (DONE, {"prompt": [1, True]}, 400, "prompt must be"),
    (DONE, {"prompt": [1, 999999]}, 400, "out of the vocabulary"),
    (DONE, {"prompt": [-1]}, 400, "out of the vocabulary"),
    (DONE, {"prompt": "a", "max_tokens": "5"}, 400, "max_tokens: Input should be a valid integer, got '5'"),
    (DONE, {"prompt": "a", "max_tokens": 5.5}, 400, "max_tokens"),
    (DONE, {"prompt": "a", "max_tokens": 0}, 400, "max_tokens must be at least 1 unless echo is true"),
    (DONE, {"prompt": "a", "max_tokens": -1}, 400, "greater than or equal to 0"),
    (DONE, {"prompt": "a", "max_tokens": 10**30}, 400, "max_tokens"),
    (DONE, {"prompt": "a", "max_tokens": 5000}, 400, "maximum context length is 1024 tokens"),
    (DONE, {"prompt": "word " * 1100}, 400, "maximum context length"),
    (DONE, {"prompt": "a", "temperature": -0.1}, 400, "temperature"),
    (DONE, {"prompt": "a", "temperature": 9}, 400, "temperature"),
    (DONE, {"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    (DONE, {"prompt": "a", "top_p": 0}, 400, "top_p"),
    (DONE, {"prompt": "a", "top_p": 1.5}, 400, "top_p"),
    (DONE, {"prompt": "a", "top_k": -2}, 400, "top_k"),
    (DONE, {"prompt": "a", "n": 0}, 400, "n:"),
    (DONE, {"prompt": "a", "n": 10000}, 400, "n:"),
    (DONE, {"prompt": "a", "seed": -1}, 400, "seed"),
    (DONE, {"prompt": "a", "seed": 2**64}, 400, "seed"),
    (DONE, {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
    (DONE, {"prompt": "a", "logprobs": True}, 400, "logprobs"),
    (DONE, {"prompt": "a", "stop": ["x"] * 17}, 400, "stop must be"),
    (DONE, {"prompt": "a", "stop": [""]}, 400, "stop must be"),
    (DONE, {"prompt": "a", "stop": 3}, 400, "stop must be"),
    (DONE, {"prompt": "a", "stream": "yes"}, 400, "stream"),
    (DONE, {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "only allowed with stream"),
    (DONE, {"prompt": "a", "stream": True, "stream_options": {"include_usage": 1}}, 400, "include_usage"),
    (DONE, {"prompt": "a", "presence_penalty": -2.5}, 400, "presence_penalty"),
    (DONE, {"prompt": "a", "frequency_penalty": 3}, 400, "frequency_penalty"),
    (DONE, {"prompt": "a", "logit_bias": {"x5": 1.0}}, 400, "logit_bias keys must be token ids"),
    (DONE, {"prompt": "a", "logit_bias": {"\u00b2": 1.0}}, 400, "logit_bias keys must be token ids"),
    (DONE, {"prompt": "a", "logit_bias": {"5": 101}}, 400, "logit_bias values must be in [-100, 100]"),
    (DONE, {"prompt": "a", "logit_bias": {str(i): 1 for i in range(301)}}, 400, "at most 300 tokens"),
    (DONE, {"prompt": "a", "logit_bias": {"99999999": 1}}, 400, "logit_bias token id 99999999 is out of the vocabulary"),
    (CHAT, {"messages": USER, "logit_bias": {"-1": 1}}, 400, "logit_bias keys"),
    (DONE, {"prompt": "a", "best_of": 3}, 400, "best_of"),
    (DONE, {"prompt": "a", "suffix": "z"}, 400, "suffix"),
    (DONE, {"prompt": "a", "model": 7}, 400, "model"),
    (DONE, {"prompt": "a", "model": "gpt-4o"}, 404, "does not exist"),
    (CHAT, {"model": "gpt-4o", "messages": USER}, 404, "does not exist"),
    (CHAT, {}, 400, "messages is required"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "role is required"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "a message of role 'user' needs content"),
    (CHAT, {"messages": [*USER, {"role": "assistant", "content": None}]}, 400, "a message of role 'assistant' needs content"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "content must be a string or a list of text parts"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "only text content parts"),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 1100}]}, 400, "maximum context length"),
    (CHAT, {"messages": USER, "max_tokens": 1020}, 400, "maximum context length"),
    (CHAT, {"messages": USER, "max_tokens": 5, "max_completion_tokens": 6}, 400, "differ"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs needs logprobs"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    (CHAT, {"messages": USER, "logprobs": 3}, 400, "logprobs"),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "function is required"),
    (CHAT, {"messages": USER, "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, 400, "tools.0.type"),
    (CHAT, {"messages": USER, "tool_choice": "auto"}, 400, "tool_choice needs tools"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "names function 'g', which is not among the tools (f)"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
            "response_format": {"type": "json_object"}}, 400, "cannot be combined with a JSON response_format"),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
            "tool_choice": "required"}, 400, "grammar cannot be compiled"),
    (CHAT, {"messages": USER, "response_format": {"type": "yaml"}}, 400, "'text', 'json_object' or 'json_schema'"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema"}}, 400, "needs json_schema.schema"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
     400, "json_schema cannot be compiled: Invalid type: nonsense"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
     400, "json_schema cannot be compiled: Invalid type: nonsense"),
    (CHAT, {"messages": USER, "chat_template_kwargs": {"messages": []}}, 400, "may not set"),
    (CHAT, {"messages": USER, "chat_template_kwargs": "x"}, 400, "chat_template_kwargs"),
]


@pytest.mark.parametrize("path, body, status, words", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_bad_requests_get_openai_errors(gateway, router, path, body, status, words):
    before = len(router.record.requests)
    started = time.monotonic()
    code, payload, _ = post(gateway, path, body)
    assert time.monotonic() - started < 10
    assert code == status, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"], error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert len(router.record.requests) == before  # refused before reaching the router


def test_context_error_is_shaped_like_openais(gateway):
    code, payload, _ = post(gateway, DONE, {"prompt": "a", "max_tokens": 5000})
    assert payload["error"]["code"] == "context_length_exceeded" and payload["error"]["param"] == "prompt"


def test_oversized_body_is_413(gateway, router):
    body = json.dumps({"prompt": "x" * 70_000}).encode()  # the test gateway allows 64 KiB
    code, payload, _ = post(gateway, DONE, body)
    assert code == 413 and "limit is 65536 bytes" in payload["error"]["message"]
    # a chunked body (no Content-Length) is measured while it arrives
    parts = urlsplit(gateway)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
        chunk = b"x" * 16384
        for _ in range(6):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        sock.sendall(b"0\r\n\r\n")
        reply = sock.recv(65536).decode(errors="replace")
    assert reply.startswith("HTTP/1.1 413"), reply[:200]


def test_unknown_paths_and_methods(gateway):
    code, payload, _ = request(gateway, "GET", "/v1/nothing")
    assert code == 404 and payload["error"]["type"] == "not_found_error"
    code, payload, _ = request(gateway, "GET", DONE)
    assert code == 405 and "not allowed" in payload["error"]["message"]


def test_the_openai_client_sees_typed_errors(openai_client):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.NotFoundError) as info:
        openai_client.completions.create(model="gpt-4o", prompt="x")
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        openai_client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4096)


def test_a_chat_template_that_does_not_compile_is_logged_at_start_and_answers_400(router, tmp_path, caplog):
    """Compiled at the gateway's start (not in the first chat request's TTFT); a broken one is a
    warning there, and each chat request a 400 naming the template — completions still serve."""
    import shutil

    from splitserve.engine.default_model import default_model_path
    from splitserve.gateway.config import GatewayConfig
    from tests.fixtures.gateway_server import running_gateway

    model = tmp_path / "model"
    shutil.copytree(default_model_path(), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{% if %}broken"}))
    with caplog.at_level("WARNING", logger="splitserve.gateway.app"):
        with running_gateway(GatewayConfig(router=router.address, model=model, served_model_name=MODEL)) as url:
            status, body, _ = post(url, CHAT, {"model": MODEL, "messages": USER, "max_tokens": 2})
            assert status == 400 and "chat template rejected the messages" in body["error"]["message"], body
            assert post(url, DONE, {"model": MODEL, "prompt": "hi", "max_tokens": 2})[0] == 200
    assert "chat template of splitserve-default does not compile (TemplateSyntaxError" in caplog.text


def test_prompt_log_probs_past_one_answers_limit_are_refused(gateway, router, monkeypatch):
    from splitserve.gateway import completions

    monkeypatch.setattr(completions, "MAX_PROMPT_LOGPROB_ENTRIES", 100)
    before = len(router.record.requests)
    code, payload, _ = post(gateway, DONE, {"prompt": list(range(3, 53)), "echo": True, "logprobs": 2, "max_tokens": 1})
    assert code == 400 and "asks for 150 log-probs, more than the 100 one answer carries" in payload["error"]["message"]
    assert len(router.record.requests) == before
    code, _, _ = post(gateway, DONE, {"prompt": list(range(3, 53)), "echo": True, "logprobs": 0, "max_tokens": 1})
    assert code == 200  # 50 entries
