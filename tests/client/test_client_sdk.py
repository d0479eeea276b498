"""The gRPC client SDK: typed params and results, prompt forms, status-code → exception mapping, retries
with backoff, streaming, abort and cancellation — sync and async, against a scripted router.
(The SDK against a real cluster, lifecycle and topology included: tests/e2e/test_e2e_up.py.)"""

import asyncio
import shutil
import subprocess
import time

import grpc
import pytest

from splitserve.client import (
    AsyncClient,
    Client,
    ClientOptions,
    DeadlineExceededError,
    FinishReason,
    InvalidRequestError,
    OverloadedError,
    SamplingParams,
    TLSConfig,
    UnavailableError,
)
from splitserve.client.errors import AuthenticationError, InternalError, error_from_rpc
from splitserve.client.prompts import as_prompt_list
from splitserve.engine.default_model import default_model_path
from splitserve.engine.tokenizer import Tokenizer
from tests.fixtures.scripted_router import DEFAULT_TEXT, ScriptedRouter

FAST_RETRY = ClientOptions(initial_backoff_s=0.01, max_backoff_s=0.02, max_attempts=3)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(default_model_path())


@pytest.fixture(scope="module")
def router(tokenizer):
    router = ScriptedRouter(tokenizer)
    router.start()
    yield router
    router.stop()


@pytest.fixture
def client(router, tokenizer):
    with Client(router.address, tokenizer=tokenizer, options=FAST_RETRY, return_timing=True) as client:
        yield client


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(num_tokens_to_generate=0), "num_tokens_to_generate"),
        (dict(num_tokens_to_generate=True), "num_tokens_to_generate"),
        (dict(temperature=-1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=2), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(seed=-5), "seed"),
        (dict(top_n_logprobs=21), "top_n_logprobs"),
        (dict(stop_words=[""]), "stop_words"),
        (dict(termination_id=-1), "termination_id"),
        (dict(output_offset=-1), "output_offset"),
    ],
)
def test_sampling_params_are_validated(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kwargs)


def test_prompt_forms():
    assert as_prompt_list("a") == ["a"]
    assert as_prompt_list([1, 2]) == [[1, 2]]
    assert as_prompt_list(["a", [1, 2]]) == ["a", [1, 2]]
    for bad in ([], 5, [[]], [1.5], [True, 2], None):
        with pytest.raises(InvalidRequestError, match="prompts must be"):
            as_prompt_list(bad)


class _Rpc(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return "because"


def test_status_codes_map_to_exceptions():
    cases = {
        grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError, grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
        grpc.StatusCode.UNAVAILABLE: UnavailableError, grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
        grpc.StatusCode.UNAUTHENTICATED: AuthenticationError, grpc.StatusCode.DATA_LOSS: InternalError,
    }  # fmt: skip
    for code, kind in cases.items():
        error = error_from_rpc(_Rpc(code), "Generate on x")
        assert type(error) is kind and error.code == code and error.details == "because"
        assert str(error) == f"Generate on x failed: {code.name}: because"


def test_options_are_validated():
    with pytest.raises(ValueError, match="max_attempts"):
        ClientOptions(max_attempts=0)
    with pytest.raises(ValueError, match="initial_backoff_s"):
        ClientOptions(initial_backoff_s=3, max_backoff_s=1)
    with pytest.raises(ValueError, match="reconnect_wait_s"):
        ClientOptions(reconnect_wait_s=-1)
    with pytest.raises(ValueError, match="both private_key and certificate_chain"):
        TLSConfig(private_key=b"k")
    assert all(0.08 <= ClientOptions().backoff_s(1) <= 0.12 for _ in range(20))
    assert ClientOptions().backoff_s(10) <= 2.4


def test_the_engines_sampling_params_are_taken_field_by_field(client, router):
    """Code moves between `LLM.generate` and `Client.generate` unchanged: `splitserve.SamplingParams`
    (the engine's) is sent as the SDK's; its options the router's API has no field for are refused
    by name, before anything is sent."""
    from splitserve import SamplingParams as EngineSamplingParams

    sent_before = len(router.record.requests)
    params = EngineSamplingParams(num_tokens_to_generate=5, temperature=0.0, top_k=3, top_p=0.5, seed=7,
                                  stop_words=("zz",), return_log_probs=True, top_n_logprobs=2)  # fmt: skip
    [result] = client.generate("Hello", params)
    assert len(result.generated_tokens) == 5 and len(result.top_n_logprobs) == 5
    sent = router.record.requests[sent_before].sampling_params
    assert (sent.num_tokens_to_generate, sent.temperature, sent.top_k, sent.top_p, sent.seed, list(sent.stop_words),
            sent.return_log_probs, sent.top_n_logprobs) == (5, 0.0, 3, 0.5, 7, ["zz"], True, 2)  # fmt: skip
    with pytest.raises(ValueError, match=r"cannot carry \{'ignore_eos': True\}"):
        client.generate("Hello", EngineSamplingParams(ignore_eos=True))
    with pytest.raises(ValueError, match="num_tokens_total"):
        client.generate("Hello", EngineSamplingParams(num_tokens_to_generate=None, num_tokens_total=64))
    with pytest.raises(TypeError, match="params must be splitserve.client.SamplingParams"):
        client.generate("Hello", {"num_tokens_to_generate": 3})
    assert len(router.record.requests) == sent_before + 1


def test_repeated_request_ids_are_refused_before_anything_is_sent(client, router):
    sent_before = len(router.record.requests)
    with pytest.raises(ValueError, match=r"request ids must be unique within a call; repeated: \['x'\]"):
        client.generate(["a", "b", "c"], request_ids=["x", "y", "x"])
    assert len(router.record.requests) == sent_before


def test_generate_returns_typed_results_in_input_order(client, tokenizer):
    params = SamplingParams(num_tokens_to_generate=64, return_log_probs=True, top_n_logprobs=2)
    results = client.generate(["Hello", [1, 500, 600], "Third"], params)
    assert [r.prompt_tokens for r in results] == [tuple(tokenizer.encode("Hello")), (1, 500, 600),
                                                  tuple(tokenizer.encode("Third"))]  # fmt: skip
    for r in results:
        assert r.generated_text == DEFAULT_TEXT and r.finish_reason is FinishReason.STOP
        assert r.generated_tokens[-1] == tokenizer.eos_token_id
        assert len(r.generated_log_probs) == len(r.top_n_logprobs) == len(r.generated_tokens)
        assert all(len(top) == 2 for top in r.top_n_logprobs)
        assert r.usage.completion_tokens == len(r.generated_tokens) and r.usage.prompt_tokens == r.prompt_length
        assert r.routing.decode_worker_id == "scripted" and r.ttft is not None and r.ttft >= 0
    short = client.generate("Hello", SamplingParams(num_tokens_to_generate=2))[0]
    assert short.finish_reason is FinishReason.LENGTH and len(short.generated_tokens) == 2


def test_stream_yields_deltas_then_the_result(client):
    chunks = list(client.stream("Hello", SamplingParams(num_tokens_to_generate=64), request_id="stream-1"))
    assert all(c.result is None for c in chunks[:-1]) and chunks[-1].is_last
    assert "".join(c.text for c in chunks) == DEFAULT_TEXT == chunks[-1].result.generated_text
    assert sum((c.token_ids for c in chunks), ()) == chunks[-1].result.generated_tokens
    assert {c.request_id for c in chunks} == {"stream-1"}


def test_text_needs_a_tokenizer(router):
    with Client(router.address) as bare:
        with pytest.raises(InvalidRequestError, match="a text prompt needs a tokenizer"):
            bare.generate("Hello")
        [result] = bare.generate([1, 2, 3])
        assert result.generated_text is None and result.generated_tokens
        with pytest.raises(ValueError, match="control_plane"):
            bare.pause()


def test_abort_ends_the_stream_and_leaving_early_cancels(client, router):
    stream = client.stream("SLOW", SamplingParams(num_tokens_to_generate=500), request_id="abort-me")
    first = next(stream)
    assert first.token_ids
    assert client.abort("abort-me") is True
    last = list(stream)[-1]
    assert last.result.finish_reason is FinishReason.ABORT
    assert client.abort("abort-me") is False  # no longer running
    stream = client.stream("SLOW", SamplingParams(num_tokens_to_generate=500), request_id="leave-early")
    next(stream)
    stream.close()
    deadline = time.monotonic() + 5
    while "leave-early" not in router.record.cancelled and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "leave-early" in router.record.cancelled


def test_retries_unavailable_before_output_only(client, router):
    router.fail_first = 2
    [result] = client.generate([1, 2])
    assert result.generated_tokens and [r.request_id for r in router.record.requests].count(result.request_id) == 3
    router.fail_first = 3
    with pytest.raises(UnavailableError, match="UNAVAILABLE: no decode worker"):
        client.generate([1, 2])
    router.fail_first = 0
    with pytest.raises(OverloadedError, match="RESOURCE_EXHAUSTED"):
        client.generate("OVERLOAD")
    with pytest.raises(DeadlineExceededError):
        client.generate("SLOW", SamplingParams(num_tokens_to_generate=500), timeout_s=0.3)


def test_a_stream_the_router_drops_after_tokens_goes_on_from_them(client, router, tokenizer):
    """UNAVAILABLE after tokens came (the router died mid-stream): the SDK asks for the rest
    (client/resume.py) — prompt + the tokens received, `output_offset` = their count, a budget of
    what is left, the same seed and stop words — and the caller sees one stream, one result."""
    params = SamplingParams(num_tokens_to_generate=64, temperature=0.7, seed=11, stop_words=("zzz",),
                            return_log_probs=True, return_prompt_log_probs=True)
    before = len(router.record.requests)
    router.break_first = 1
    chunks = list(client.stream("Hello", params, request_id="resume-me"))
    result = chunks[-1].result
    assert "".join(c.text for c in chunks) == DEFAULT_TEXT == result.generated_text
    assert sum((c.token_ids for c in chunks), ()) == result.generated_tokens and {c.request_id for c in chunks} == {"resume-me"}
    assert len(result.generated_log_probs) == len(result.generated_tokens)
    assert result.usage.prompt_tokens == len(tokenizer.encode("Hello")) and result.usage.completion_tokens == len(result.generated_tokens)
    first, resumed = router.record.requests[before:]
    sent = list(chunks[0].token_ids)
    assert resumed.request_id == "resume-me.resume1" and list(resumed.token_ids) == [*first.token_ids, *sent]
    p = resumed.sampling_params
    assert (p.output_offset, p.num_tokens_to_generate, p.seed, list(p.stop_words)) == (len(sent), 64 - len(sent), 11, ["zzz"])
    # the prompt's log-probs come with the first token: the resumed request does not ask again
    assert first.sampling_params.return_prompt_log_probs and not p.return_prompt_log_probs
    router.break_first = 1
    with Client(router.address, tokenizer=tokenizer, options=ClientOptions(resume_streams=False)) as strict:
        with pytest.raises(UnavailableError, match="Stream removed"):
            list(strict.stream("Hello", params))
    router.break_first = 1

    async def via_async():
        async with AsyncClient(router.address, tokenizer=tokenizer, options=FAST_RETRY) as sdk:
            return await sdk.generate("Hello", params)

    [again] = asyncio.run(via_async())
    assert again.generated_text == DEFAULT_TEXT and router.record.requests[-1].request_id.endswith(".resume1")
    router.break_first = 0


@pytest.mark.parametrize("wait_s", [0.0, 8.0])
def test_reconnect_wait_rides_out_a_router_restart(tokenizer, wait_s):
    """With `reconnect_wait_s` a call that finds the router down waits for it to come back (here
    it starts 1 s after the call); without, it fails at once with UnavailableError."""
    import threading

    from splitserve.readiness import free_port

    port, late = free_port(), ScriptedRouter(tokenizer)
    options = ClientOptions(initial_backoff_s=0.01, max_backoff_s=0.02, max_attempts=2, reconnect_wait_s=wait_s)
    threading.Timer(1.0, lambda: late.start(port=port)).start()
    timer_set = time.monotonic()
    try:
        with Client(f"127.0.0.1:{port}", tokenizer=tokenizer, options=options) as sdk:
            started = time.monotonic()
            if wait_s:
                [result] = sdk.generate("a", SamplingParams(num_tokens_to_generate=64))
                assert result.generated_text == DEFAULT_TEXT and 0.9 < time.monotonic() - started < wait_s
            else:
                with pytest.raises(UnavailableError):
                    sdk.generate("a")
                assert time.monotonic() - started < 0.9
    finally:
        time.sleep(max(0.0, 1.2 - (time.monotonic() - timer_set)))  # the timer has started it by now
        late.stop()


def test_async_client(router, tokenizer):
    async def main():
        async with AsyncClient(router.address, tokenizer=tokenizer, options=FAST_RETRY) as client:
            assert await client.health()
            results = await client.generate(["a", "b", [1, 7]], SamplingParams(num_tokens_to_generate=64))
            assert [r.generated_text for r in results] == [DEFAULT_TEXT] * 3
            text = "".join([c.text async for c in client.stream("Hello", SamplingParams(num_tokens_to_generate=64))])
            assert text == DEFAULT_TEXT
            stream = client.stream("SLOW", SamplingParams(num_tokens_to_generate=500), request_id="async-abort")
            await anext(stream)
            assert await client.abort("async-abort")
            chunks = [c async for c in stream]
            assert chunks[-1].result.finish_reason is FinishReason.ABORT
            with pytest.raises(OverloadedError):
                await client.generate("OVERLOAD")
            # cancelling the consuming task cancels the call
            async def consume():
                async for _ in client.stream("SLOW", request_id="async-cancel"):
                    pass
            task = asyncio.create_task(consume())
            await asyncio.sleep(0.2)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        deadline = time.monotonic() + 5
        while "async-cancel" not in router.record.cancelled and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert "async-cancel" in router.record.cancelled

    asyncio.run(main())


def test_tls(tmp_path, tokenizer):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True)  # fmt: skip
    router = ScriptedRouter(tokenizer)
    address = router.start(tls=(key.read_bytes(), cert.read_bytes()))
    try:
        tls = TLSConfig(root_certificates=cert, server_name_override="localhost")
        with Client(address, tokenizer=tokenizer, options=ClientOptions(tls=tls)) as client:
            assert client.generate("Hello", SamplingParams(num_tokens_to_generate=64))[0].generated_text == DEFAULT_TEXT
        with Client(address, options=ClientOptions(max_attempts=1, timeout_s=5)) as plaintext:
            with pytest.raises(UnavailableError):
                plaintext.generate([1, 2])
    finally:
        router.stop()
