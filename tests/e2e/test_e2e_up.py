"""`splitserve up` end to end: one real cluster for the module — a real etcd, the control plane, a prefill and
a decode worker on the embedded default model, the router and the gateway, all started by the command a user
types. The unmodified `openai` client and the gRPC SDK talk to it; greedy output equals `LLM.generate`; SIGTERM
leaves no process behind."""

import asyncio
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

import pytest

import splitserve
from splitserve.client import AsyncClient, Client, FinishReason, LifecycleState, SamplingParams
from tests.e2e.process_tree import alive, descendants
from tests.gateway.http_helpers import post, request

openai = pytest.importorskip("openai")
if shutil.which("etcd") is None:
    pytest.skip("needs the etcd binary (apt-get install etcd-server)", allow_module_level=True)

MODEL = "splitserve-default"
STARTUP_LIMIT_S = 30.0
LONG_PROMPT = "def parse_arguments(argv):\n    parser = argparse.ArgumentParser(description='Process some files.')\n"  * 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    work = tmp_path_factory.mktemp("up")
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "splitserve", "up", "--port", "0", "--work-dir", str(work)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )  # fmt: skip
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    output: list[str] = []
    url = None
    while url is None:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            line = None
        if line is not None:
            output.append(line)
            url = line.split()[1] if line.startswith("READY ") else None
        elif time.monotonic() - started > 120 or proc.poll() is not None:
            _stop(proc)
            raise RuntimeError("splitserve up did not become ready:\n" + "".join(output))
    startup_s = time.monotonic() - started
    sdk = re.search(r"(splitserve\.client\.Client\('([^']+)', control_plane='([^']+)', tokenizer='default'\))",
                    "".join(output))
    info = dict(proc=proc, url=url, sdk_line=sdk.group(1), router=sdk.group(2), control_plane=sdk.group(3),
                startup_s=startup_s, output=output, lines=lines, work=work)  # fmt: skip
    yield info
    _stop(proc)


def _stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # up stops its children (and the kernel would, were it killed)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def oai(cluster):
    with openai.OpenAI(base_url=f"{cluster['url']}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def llm():
    from splitserve import LLM

    return LLM(block_size_tokens=16)


def test_up_starts_within_30_s_and_prints_where_to_go(cluster):
    assert cluster["startup_s"] < STARTUP_LIMIT_S, "".join(cluster["output"])
    text = "".join(cluster["output"])
    for part in ("etcd", "control plane", "prefill worker", "decode worker", "router", "gateway", "/v1"):
        assert part in text


def test_models_and_unknown_model(oai):
    assert [m.id for m in oai.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.completions.create(model="gpt-4o", prompt="x")


def test_bad_input_is_4xx(cluster, oai):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oai.completions.create(model=MODEL, prompt="x", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        oai.completions.create(model=MODEL, prompt="x", max_tokens=5000)
    assert post(cluster["url"], "/v1/chat/completions", b"{nope")[0] == 400


def test_completion_chat_and_greedy_equals_llm(oai, cluster, llm):
    from splitserve import SamplingParams as EngineParams

    prompts = ["def fibonacci(n):", "import os\nimport sys\n\n"]
    expected = llm.generate(prompts, EngineParams(num_tokens_to_generate=24, temperature=0.0))
    for prompt, want in zip(prompts, expected, strict=True):
        out = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert out.choices[0].text == want.generated_text
        assert out.usage.completion_tokens == len(want.generated_tokens)
    with eval(cluster["sdk_line"], {"splitserve": splitserve}) as client:  # the banner's line, pasted as printed
        results = client.generate(prompts, SamplingParams(num_tokens_to_generate=24, temperature=0))
    assert [r.generated_tokens for r in results] == [tuple(e.generated_tokens) for e in expected]
    assert all(r.routing.prefill_worker_id for r in results)  # disaggregated: prefill and decode workers
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What does os.getcwd do?"}],
                                       max_tokens=16, temperature=0)  # fmt: skip
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    assert chat.choices[0].finish_reason in ("stop", "length")


def test_penalties_and_logit_bias_equal_llm(oai, cluster, llm):
    """Through the gateway, the router, the prefill worker (the first token: the bias) and the decode
    worker (the rest: penalties counting that first token too), as one engine computes them."""
    from splitserve import SamplingParams as EngineParams

    prompt, bias = "def fibonacci(n):", {"25": 1.5, "11": -2.0}
    adjust = dict(presence_penalty=0.8, frequency_penalty=1.2)
    want = llm.generate([prompt], EngineParams(num_tokens_to_generate=24, temperature=0.0,
                                               logit_bias={int(k): v for k, v in bias.items()}, **adjust))[0]  # fmt: skip
    plain = llm.generate([prompt], EngineParams(num_tokens_to_generate=24, temperature=0.0))[0]
    assert want.generated_tokens != plain.generated_tokens  # the adjustments matter here
    out = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, logit_bias=bias, **adjust)
    assert out.choices[0].text == want.generated_text
    assert out.usage.completion_tokens == len(want.generated_tokens)


def test_streaming_with_usage_and_n(oai):
    stream = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Explain json.dumps"}],
                                         max_tokens=12, temperature=0.8, seed=1, n=3, stream=True,
                                         stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    texts: dict[int, str] = {}
    finishes = {}
    for chunk in chunks[:-1]:
        choice = chunk.choices[0]
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    assert sorted(texts) == [0, 1, 2] and all(finishes.values())
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens <= 36 and usage.prompt_tokens > 0


def test_structured_output_through_the_cluster_equals_llm(oai, cluster, llm):
    """response_format: the prefill worker samples the first token and the decode worker the rest,
    each under the schema's mask (the decode worker's matcher fed the imported token) = one engine's
    guided output (through the SDK and /v1/completions); sampled chat choices follow the schema too; a schema that cannot compile is a 400."""
    from splitserve import SamplingParams as EngineParams

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
    prompt, text = "Give me a person as JSON:", json.dumps(schema)
    want = llm.generate([prompt], EngineParams(num_tokens_to_generate=60, temperature=0.0, json_schema=text))[0]
    assert want.status == "stopped" and set(json.loads(want.generated_text)) == {"name", "age"}
    with eval(cluster["sdk_line"], {"splitserve": splitserve}) as client:
        [got] = client.generate([prompt], SamplingParams(num_tokens_to_generate=60, temperature=0, json_schema=text))
    assert got.generated_tokens == tuple(want.generated_tokens) and got.routing.prefill_worker_id
    completion = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=0, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}})  # an extension, as vLLM's
    assert completion.choices[0].text == want.generated_text
    messages = [{"role": "user", "content": "Describe a person."}]
    chat = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=80, n=3, temperature=1.0, seed=2,
                                       response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})  # fmt: skip
    for choice in chat.choices:
        value = json.loads(choice.message.content)
        assert choice.finish_reason == "stop" and set(value) == {"name", "age"} and 0 <= value["age"] <= 120
    whole = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, response_format={"type": "json_object"})
    assert whole.choices[0].message.content.startswith("{")
    with pytest.raises(openai.BadRequestError, match="cannot be compiled"):
        oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": 2, "maxProperties": 1}}})


def test_logprobs(oai):
    out = oai.completions.create(model=MODEL, prompt="class Stack:", max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 6 and all(x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    # greedy: the chosen token is the most likely alternative
    assert all(abs(max(top.values()) - chosen) < 1e-4 for top, chosen in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       logprobs=True, top_logprobs=2)  # fmt: skip
    assert all(len(t.top_logprobs) == 2 for t in chat.choices[0].logprobs.content)


def test_cached_tokens_on_a_repeated_prompt(oai):
    first = oai.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    second = oai.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens >= 32
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_tools_are_accepted(oai):
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    out = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What time is it?"}],
                                      tools=[tool], max_tokens=8, temperature=0)  # fmt: skip
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_forced_tool_calls_follow_their_tools_schemas(oai):
    """tool_choice "required" / a named function: the output is Hermes tool calls whose arguments
    follow the tool's parameters (gateway/tool_grammar.py), parsed into `tool_calls`; streamed
    deltas add up to the whole answer's call."""
    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
               "required": ["city", "unit"], "additionalProperties": False}  # fmt: skip
    clock = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 6}}, "required": ["tz"],
             "additionalProperties": False}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}},
             {"type": "function", "function": {"name": "get_time", "parameters": clock}}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, names in (("required", {"get_weather", "get_time"}), (named, {"get_time"})):
        out = oai.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice=choice,
                                          parallel_tool_calls=False, max_tokens=80, temperature=0)  # fmt: skip
        answer = out.choices[0]
        assert answer.finish_reason == "tool_calls" and len(answer.message.tool_calls) == 1, answer
        call = answer.message.tool_calls[0]
        arguments = json.loads(call.function.arguments)
        assert call.function.name in names
        assert set(arguments) == set((weather if call.function.name == "get_weather" else clock)["required"])
    stream = oai.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice=named,
                                         parallel_tool_calls=False, max_tokens=80, temperature=0, stream=True)  # fmt: skip
    pieces = [d for chunk in stream if chunk.choices for d in chunk.choices[0].delta.tool_calls or []]
    assert "".join(d.function.arguments or "" for d in pieces) == call.function.arguments
    assert [d.function.name for d in pieces if d.function.name] == ["get_time"]


def test_sdk_sync_async_stream_and_abort(cluster):
    params = SamplingParams(num_tokens_to_generate=8, temperature=0)
    with Client(cluster["router"], tokenizer="default") as client:
        assert client.health()
        chunks = list(client.stream("def main():", params))
        assert "".join(c.text for c in chunks) == chunks[-1].result.generated_text

    async def main():
        async with AsyncClient(cluster["router"], tokenizer="default") as client:
            results = await client.generate(["a = 1", "b = 2"], params)
            assert [r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for r in results] == [True, True]
            text = "".join([c.text async for c in client.stream("x = ", params)])
            assert text == results[0].generated_text or text  # a different prompt: just some text

    asyncio.run(main())


def test_sdk_abort_ends_the_stream(cluster):
    with Client(cluster["router"], tokenizer="default") as client:
        params = SamplingParams(num_tokens_to_generate=800, temperature=0)
        stream = client.stream("import re\n", params, request_id="e2e-abort", timeout_s=4)
        next(stream)
        assert client.abort("e2e-abort") is True
        try:
            assert list(stream)[-1].result.finish_reason is FinishReason.ABORT
        finally:
            stream.close()


def test_sdk_lifecycle_and_topology(cluster):
    from splitserve.engine.default_model import default_model_path

    with Client(cluster["router"], control_plane=cluster["control_plane"], tokenizer="default") as client:
        topology = client.topology()
        assert topology.is_complete and sorted(w.role for w in topology.workers) == ["decode", "prefill"]
        assert client.pause().state is LifecycleState.PAUSED
        assert client.suspend().state is LifecycleState.SUSPENDED
        version = client.topology().lifecycle.weights_version
        assert client.reload_weights(default_model_path()).weights_version == version + 1
        assert client.resume().state is LifecycleState.PAUSED
        assert client.unpause().state is LifecycleState.RUNNING
        deadline = time.monotonic() + 60
        while True:  # workers follow the lifecycle asynchronously
            try:
                [result] = client.generate("x = 1", SamplingParams(num_tokens_to_generate=4, temperature=0), timeout_s=20)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        assert result.generated_tokens


def test_client_disconnect_aborts_the_request_in_the_cluster(cluster):
    parts = urlsplit(cluster["url"])
    body = json.dumps({"model": MODEL, "prompt": "import os\n", "max_tokens": 900, "temperature": 0.0,
                       "stream": True}).encode()  # fmt: skip
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        head = sock.recv(65536).decode()
        request_id = re.search(r"x-request-id: (\S+)", head, re.I).group(1)
    deadline = time.monotonic() + 10
    while "splitserve_gateway_client_disconnects_total 1.0" not in request(cluster["url"], "GET", "/metrics")[1]:
        assert time.monotonic() < deadline, "the gateway did not notice the disconnect"
        time.sleep(0.05)
    time.sleep(0.3)
    with Client(cluster["router"]) as client:  # 900 tokens take seconds: only a cancel ends it this soon
        assert client.abort(f"{request_id}-0") is False  # already gone from the router (and so the workers)


def test_sigterm_stops_every_process(cluster):
    """Last in the module: it stops the cluster."""
    proc = cluster["proc"]
    family = descendants(proc.pid)
    assert len(family) >= 6  # etcd, control plane, 2 workers, router, gateway (+ their helpers)
    started = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(90) == 0
    time.sleep(0.2)
    rest = "".join(cluster["lines"].queue)
    assert "no process left running" in rest, rest
    left = [pid for pid in family if alive(pid)]
    assert not left, f"orphans: {left}"
    assert time.monotonic() - started < 60
