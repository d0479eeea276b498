"""The gateway's OpenAI API over real HTTP (the official `openai` client and raw requests), in front of a
scripted router: response shapes, streaming, n, batches, echo, log-probs, stop strings, tool calls,
reasoning, usage and cached tokens, how OpenAI fields become sampling params, router errors."""

import itertools
import json
import time

import pytest

from splitserve.gateway.config import GatewayConfig
from tests.fixtures.gateway_server import running_gateway
from tests.fixtures.scripted_router import DEFAULT_TEXT
from tests.gateway.conftest import MODEL
from tests.gateway.http_helpers import post, request

WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather in a city",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}  # fmt: skip
CALL_TEXT = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}</tool_call>'


def _last_request(router):
    return router.record.requests[-1]


def test_models_health_metrics_and_openapi(gateway, openai_client):
    assert [m.id for m in openai_client.models.list()] == [MODEL]
    assert openai_client.models.retrieve(MODEL).id == MODEL
    status, body, _ = request(gateway, "GET", "/v1/models/other")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert request(gateway, "GET", "/health")[:2] == (200, {"status": "ok", "model": MODEL})
    status, doc, _ = request(gateway, "GET", "/openapi.json")
    assert status == 200
    schema = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "messages" in schema["properties"] and "top_logprobs" in schema["properties"]
    status, text, _ = request(gateway, "GET", "/metrics")
    assert status == 200 and "splitserve_gateway_requests_total" in text


def test_completion_whole_answer(openai_client, router):
    out = openai_client.completions.create(model=MODEL, prompt="Hello", max_tokens=32, temperature=0)
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    [choice] = out.choices
    assert (choice.index, choice.text, choice.finish_reason, choice.logprobs) == (0, DEFAULT_TEXT, "stop", None)
    num_text = len(router.tokenizer.encode(DEFAULT_TEXT, add_bos=False))
    assert out.usage.completion_tokens == num_text + 1  # + EOS
    assert list(_last_request(router).token_ids) == router.tokenizer.encode("Hello", add_bos=True)
    assert out.usage.prompt_tokens == len(_last_request(router).token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    short = openai_client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    assert DEFAULT_TEXT.startswith(short.choices[0].text)


def test_batch_n_echo_and_seeds(openai_client, router, tokenizer):
    out = openai_client.completions.create(model=MODEL, prompt=["First", "Second"], n=2, seed=7, echo=True,
                                           max_tokens=4)  # fmt: skip
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text.split(" ")[0] for c in out.choices] == ["First", "First", "Second", "Second"]
    recent = router.record.requests[-4:]
    assert sorted(r.sampling_params.seed for r in recent) == [7, 7, 8, 8]  # choice i gets seed + i
    num_prompt = sum(len(tokenizer.encode(p)) for p in ("First", "Second"))
    assert out.usage.prompt_tokens == num_prompt and out.usage.completion_tokens == 16  # prompts count once
    ids = openai_client.completions.create(model=MODEL, prompt=[1, 400, 500], max_tokens=2)
    assert list(_last_request(router).token_ids) == [1, 400, 500] and ids.usage.prompt_tokens == 3


def test_completion_logprobs(openai_client):
    out = openai_client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert lp.token_logprobs[0] == pytest.approx(-0.25) and all(len(top) == 2 for top in lp.top_logprobs)


def test_stop_strings_cut_the_text_whole_and_streamed(openai_client, router):
    whole = openai_client.completions.create(model=MODEL, prompt="Hi", max_tokens=40, stop=["fox", "zzz"])
    assert whole.choices[0].text == " the quick brown " and whole.choices[0].finish_reason == "stop"
    assert list(_last_request(router).sampling_params.stop_words) == ["fox", "zzz"]  # the workers stop too
    stream = openai_client.completions.create(model=MODEL, prompt="Hi", max_tokens=40, stop="fox", stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == " the quick brown "
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_streaming_with_usage(openai_client):
    stream = openai_client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=40, stream=True, stream_options={"include_usage": True}, n=2
    )
    chunks = list(stream)
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        assert chunk.usage is None and len(chunk.choices) == 1
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == {0: DEFAULT_TEXT, 1: DEFAULT_TEXT}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * (chunks[-1].usage.completion_tokens // 2)
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + chunks[-1].usage.completion_tokens


def test_chat_whole_and_streamed_with_logprobs(openai_client, router, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something"}]
    out = openai_client.chat.completions.create(model=MODEL, messages=messages, logprobs=True, top_logprobs=2)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == DEFAULT_TEXT
    content = out.choices[0].logprobs.content
    assert "".join(t.token for t in content[:-1]) == DEFAULT_TEXT and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].bytes == list(content[0].token.encode())
    rendered = tokenizer.apply_chat_template(messages)
    assert list(_last_request(router).token_ids) == tokenizer.encode(rendered, add_bos=False)
    # no max_tokens: the rest of the context
    assert _last_request(router).sampling_params.num_tokens_to_generate == 1024 - out.usage.prompt_tokens
    chunks = list(openai_client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                        stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == DEFAULT_TEXT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens


def test_tool_calls_whole_and_streamed(openai_client, router):
    router.reply("weather", CALL_TEXT)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = openai_client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "°C"}

    stream = openai_client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], stream=True)
    calls, content, finish = {}, "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": tc.id, "name": None, "arguments": ""})
            entry["name"] = entry["name"] or (tc.function.name if tc.function else None)
            entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Checking." and finish == "tool_calls"
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == call.function.arguments
    # without tools (or tool_choice none) the text is plain content
    plain = openai_client.chat.completions.create(model=MODEL, messages=messages)
    assert plain.choices[0].message.content == CALL_TEXT and plain.choices[0].message.tool_calls is None
    # the tools reach the chat template, and an assistant turn with tool calls is accepted back
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"},
    ]
    again = openai_client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER_TOOL], tool_choice="none")
    assert again.choices[0].finish_reason == "stop"


def test_reasoning_content(router):
    openai = pytest.importorskip("openai")
    router.reply("riddle", "<think>Two plus one.</think>\n\nIt is 3.")
    with running_gateway(GatewayConfig(router=router.address, reasoning_parser="think")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "A riddle: what is 2 + 1?"}]
        message = client.chat.completions.create(model=MODEL, messages=messages).choices[0].message
        assert (message.reasoning_content, message.content) == ("Two plus one.", "It is 3.")
        reasoning = content = ""
        for chunk in client.chat.completions.create(model=MODEL, messages=messages, stream=True):
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
        assert (reasoning, content) == ("Two plus one.", "It is 3.")


def test_cached_tokens_of_a_repeated_prompt(openai_client):
    prompt = "A long shared system prompt, " * 8
    first = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    second = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


def test_openai_fields_become_sampling_params(gateway, router):
    body = {"model": MODEL, "prompt": "x", "temperature": 0.5, "top_p": 1, "top_k": -1, "seed": 3}
    assert post(gateway, "/v1/completions", body)[0] == 200
    p = _last_request(router).sampling_params
    assert (p.num_tokens_to_generate, p.temperature, p.top_p, p.top_k, p.seed) == (16, 0.5, 0.0, 0, 3)
    assert not p.return_log_probs
    assert post(gateway, "/v1/completions", {"prompt": "x", "top_p": 0.9, "top_k": 5, "logprobs": 0})[0] == 200
    p = _last_request(router).sampling_params
    assert (p.temperature, p.top_k, p.return_log_probs, p.top_n_logprobs) == (1.0, 5, True, 0)
    assert p.top_p == pytest.approx(0.9)
    chat = {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": -0.5, "frequency_penalty": 1.5,
            "logit_bias": {"42": 100, "7": -3.5}}
    assert post(gateway, "/v1/chat/completions", chat)[0] == 200
    p = _last_request(router).sampling_params
    assert (dict(p.logit_bias), p.presence_penalty, p.frequency_penalty) == ({7: -3.5, 42: 100.0}, -0.5, 1.5)
    assert not p.json_schema and not p.return_prompt_log_probs
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    formats = [({"type": "json_object"}, {"type": "object"}), ({"type": "text"}, None),
               ({"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}, schema)]
    for (path, body), (response_format, sent) in itertools.product(
            (("/v1/chat/completions", chat), ("/v1/completions", {"prompt": "x"})), formats):  # fmt: skip
        assert post(gateway, path, {**body, "response_format": response_format})[0] == 200
        p = _last_request(router).sampling_params
        assert (json.loads(p.json_schema) if p.json_schema else None) == sent
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}},
             {"type": "function", "function": {"name": "g"}}]
    for tool_choice, parallel, names in (("required", True, ["f", "g"]), ({"type": "function", "function": {"name": "g"}}, True, ["g"])):
        body = {**chat, "tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": parallel}
        assert post(gateway, "/v1/chat/completions", body)[0] == 200
        grammar = _last_request(router).sampling_params.grammar
        assert grammar.startswith("start: call") and "%json" in grammar and '"<tool_call>"' in grammar
        assert [n for n in ("f", "g") if f'"const": "{n}"' in grammar] == names
        assert ('("\\n" call)*' in grammar) == (names == ["f", "g"])  # several calls: "required" only
    assert post(gateway, "/v1/completions", {"prompt": "x", "echo": True, "logprobs": 2, "max_tokens": 0})[0] == 200
    p = _last_request(router).sampling_params  # scoring: one token generated (dropped), the prompt's log-probs
    assert (p.num_tokens_to_generate, p.return_log_probs, p.return_prompt_log_probs, p.top_n_logprobs) == (1, True, True, 2)


@pytest.mark.parametrize(
    "prompt, status, kind", [("OVERLOAD now", 429, "rate_limit_error"), ("UNAVAILABLE now", 503, "service_unavailable")]
)
def test_router_errors_become_http_errors(gateway, prompt, status, kind):
    for stream in (False, True):
        code, body, headers = post(gateway, "/v1/completions", {"prompt": prompt, "stream": stream})
        assert code == status and body["error"]["type"] == kind, body
        assert headers.get("retry-after") == "1"  # overload and unavailability say when to retry


def test_request_id_header_and_x_request_id(gateway):
    status, body, headers = post(gateway, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 200 and headers["x-request-id"] == body["id"]


def test_api_keys(router):
    with running_gateway(GatewayConfig(router=router.address, api_keys=("k1", "k2"))) as url:
        body = {"prompt": "x", "max_tokens": 2}
        status, error, headers = post(url, "/v1/completions", body)
        assert status == 401 and error["error"]["code"] == "invalid_api_key" and headers["www-authenticate"] == "Bearer"
        assert post(url, "/v1/completions", body, {"Authorization": "Bearer nope"})[0] == 401
        assert post(url, "/v1/completions", body, {"Authorization": "Basic k1"})[0] == 401
        assert post(url, "/v1/completions", body, {"Authorization": "Bearer k2"})[0] == 200
        assert request(url, "GET", "/v1/models")[0] == 401
        assert request(url, "GET", "/health")[0] == 200


def test_health_is_503_without_a_router():
    with running_gateway(GatewayConfig(router="127.0.0.1:9")) as url:
        started = time.monotonic()
        assert request(url, "GET", "/health")[0] == 503
        status, body, _ = post(url, "/v1/completions", {"prompt": "x"})
        assert status == 503 and body["error"]["type"] == "service_unavailable"
        assert body["error"]["message"].startswith("the cluster could not serve the request now"), body
        assert time.monotonic() - started < 20


def test_a_request_waits_through_a_router_restart(tokenizer):
    """A router that does not accept connections (restarting) makes new requests wait for it, up
    to ROUTER_RECONNECT_WAIT_S, rather than answer 503 at once."""
    import threading

    from splitserve.readiness import free_port
    from tests.fixtures.scripted_router import ScriptedRouter

    port = free_port()
    router = ScriptedRouter(tokenizer)
    with running_gateway(GatewayConfig(router=f"127.0.0.1:{port}")) as url:
        answers = []
        asking = threading.Thread(target=lambda: answers.append(post(url, "/v1/completions", {"prompt": "x"})))
        started = time.monotonic()
        asking.start()
        time.sleep(1.5)  # the router is down meanwhile
        router.start(port=port)
        try:
            asking.join(30)
        finally:
            router.stop()
    status, body, _ = answers[0]
    assert status == 200 and body["choices"][0]["text"], body
    assert 1.5 < time.monotonic() - started < 10


def test_an_answer_the_router_drops_midway_is_resumed_by_the_sdk(gateway, router):
    """The router died mid-answer (UNAVAILABLE after output): the SDK resumes the stream from the
    tokens sent (client/resume.py), so a whole answer and a stream both come complete, each from
    two router requests, the second asking only for the rest."""
    for stream in (False, True):
        before = len(router.record.requests)
        router.break_first = 1
        status, raw, headers = request(gateway, "POST", "/v1/completions", json.dumps(
            {"prompt": "x", "max_tokens": 64, "stream": stream}).encode())  # fmt: skip
        assert status == 200, raw
        if stream:
            assert '"error"' not in raw and "[DONE]" in raw
            events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
            text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        else:
            body = raw
            text, usage = body["choices"][0]["text"], body["usage"]
            assert headers["x-request-id"] == body["id"] and usage["prompt_tokens"] == 2  # BOS + "x", not the resume's
        assert text == DEFAULT_TEXT
        first, resumed = router.record.requests[before:]
        assert resumed.request_id == first.request_id + ".resume1"
        sent = resumed.sampling_params.output_offset
        assert sent >= 1 and list(resumed.token_ids) == [*first.token_ids, *resumed.token_ids[len(first.token_ids):]]
        assert resumed.sampling_params.num_tokens_to_generate == 64 - sent
    router.break_first = 0


def test_first_request_costs_are_paid_at_start():
    """What the first request would otherwise pay in its TTFT happens as the gateway starts: the
    chat template compiled (1–20 ms of jinja) and anyio's asyncio backend imported (5–10 ms, on
    the first stream's first chunk). A fresh interpreter: this test process has both already."""
    import subprocess
    import sys

    code = """
import asyncio, sys
from splitserve.gateway.app import create_app
from splitserve.gateway.config import GatewayConfig
app = create_app(GatewayConfig(router="127.0.0.1:1"))
assert app.state is not None and "anyio._backends._asyncio" not in sys.modules
async def main():
    async with app.router.lifespan_context(app):
        assert "anyio._backends._asyncio" in sys.modules, "anyio's backend not loaded at start"
        tokenizer = app.state.ctx.model.tokenizer
        assert tokenizer._compiled_template[0] == tokenizer.chat_template, "chat template not compiled at start"
asyncio.run(main())
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
