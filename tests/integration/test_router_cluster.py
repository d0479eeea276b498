"""The router in front of real workers: etcd + control plane + prefill + decode
workers + router. Requests through `Router.Generate` give the aggregated
engine's tokens; KV events from the workers let the router predict prefix hits."""

import shutil
from pathlib import Path

import grpc
import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.tokenizer import Tokenizer
from splitserve.engine.wire import sampling_to_proto
from splitserve.proto.v1 import (
    common_pb2,
    decode_worker_pb2,
    decode_worker_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from tests.fixtures.cluster import LocalCluster, topology, wait_for
from tests.fixtures.models import build_hf_checkpoint, build_tokenizer

pytest.importorskip("nixl_cu13")
pytest.importorskip("zmq")

FLAGS = ["--block-size", "8", "--num-blocks", "256"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("routed")
    model = tmp / "model"
    model.mkdir()
    build_hf_checkpoint(model, "llama", num_hidden_layers=2)
    workers = [("prefill-worker", FLAGS), ("prefill-worker", FLAGS), ("decode-worker", FLAGS)]
    router_flags = ["--block-size", "8", "--disagg-min-uncached-tokens", "1", "--policy", "longest_prefix"]
    spec = "tp=1,dp=2,role=prefill+tp=1,role=decode"
    with LocalCluster(tmp, str(model), spec, workers, router_flags=router_flags) as c:
        yield c


def _generate(address, rid, prompt, params):
    tokens, last = [], None
    with grpc.insecure_channel(address) as ch:
        req = router_pb2.GenerateRequest(request_id=rid, token_ids=prompt, sampling_params=sampling_to_proto(params))
        for chunk in router_pb2_grpc.RouterStub(ch).Generate(req, timeout=60):
            tokens += chunk.token_ids
            last = chunk
    return tokens, last


def test_routed_requests_match_aggregated_and_use_kv_events(cluster):
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 512, (40,), generator=g).tolist()
    prompts = [shared + [7, 8, 9], shared + [11, 12, 13, 14, 15]]
    params = SamplingParams(num_tokens_to_generate=8, temperature=0.0)
    expected = LLM(cluster.model, block_size_tokens=8, num_blocks=256).generate(prompts, params)

    tokens, last = _generate(cluster.router, "first", prompts[0], params)
    assert tokens == expected[0].generated_tokens
    assert last.routing.prefill_worker_id and last.routing.decode_worker_id  # disaggregated
    assert last.usage.prompt_tokens == 43 and last.usage.completion_tokens == 8

    # The prefill worker's BlockStored events reach the router's index; the second
    # prompt shares 5 full blocks, which the router predicts and the worker confirms.
    def predicted():
        _, chunk = _generate(cluster.router, f"probe-{predicted.n}", prompts[1], params)
        predicted.n += 1
        return chunk if chunk.routing.predicted_cached_tokens >= 40 else None

    predicted.n = 0
    holder = last.routing.prefill_worker_id
    last = wait_for(predicted, 20, "router never predicted the cached prefix")
    assert last.usage.cached_tokens >= 40
    # Of the two prefill workers, prefix-sharing prompts land on the one holding the prefix.
    assert last.routing.prefill_worker_id == holder
    tokens, last = _generate(cluster.router, "second", prompts[1], params)
    assert tokens == expected[1].generated_tokens
    assert last.routing.prefill_worker_id == holder and last.usage.cached_tokens >= 40
    # A prompt with another prefix may go anywhere; one sharing the first prefix still goes to the holder.
    other = torch.randint(3, 512, (40,), generator=g).tolist()
    _generate(cluster.router, "other", other, params)
    _, last = _generate(cluster.router, "third", shared + [20, 21], params)
    assert last.routing.prefill_worker_id == holder


def _hf_prompt_logprobs(model_dir: str, prompt: list[int]) -> torch.Tensor:
    """log-softmax at each prompt position but the last, by `transformers` (fp32)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), -1)


def test_prompt_log_probs_from_either_worker_match_transformers(cluster, tmp_path):
    """echo + logprobs through the OpenAI gateway (disaggregated: the prefill worker computes the
    prompt's log-probs) and through Router.Generate served aggregated (the decode worker does),
    max_tokens 0 (scoring) included, = transformers' log-softmax of the prompt; a second request
    for the same prompt, now cached, still gets every position (the cache is skipped for it)."""
    openai = pytest.importorskip("openai")
    from splitserve.gateway.config import GatewayConfig
    from tests.fixtures.gateway_server import running_gateway

    served = tmp_path / "served"  # what the gateway reads: the model's config and a tokenizer
    served.mkdir()
    shutil.copy(Path(cluster.model) / "config.json", served)
    build_tokenizer(served)
    tokenizer = Tokenizer(served)
    prompt = torch.randint(3, tokenizer.vocab_size, (29,), generator=torch.Generator().manual_seed(9)).tolist()
    hf = _hf_prompt_logprobs(cluster.model, prompt)
    expected = hf.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    top_values, top_ids = hf.topk(3)

    with running_gateway(GatewayConfig(router=cluster.router, model=served)) as url, \
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as client:  # fmt: skip
        name = client.models.list().data[0].id
        echo = tokenizer.decode(prompt)
        for max_tokens, stream in ((0, False), (4, False), (4, True), (0, True)):
            reply = client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens,
                                              echo=True, logprobs=3, temperature=0, stream=stream)  # fmt: skip
            chunks = list(reply) if stream else [reply]
            lists = {key: sum((c.choices[0].logprobs.model_dump()[key] for c in chunks
                               if c.choices and c.choices[0].logprobs), []) for key in ("token_logprobs", "top_logprobs")}  # fmt: skip
            lps, tops = lists["token_logprobs"], lists["top_logprobs"]
            assert len(lps) == len(prompt) + max_tokens, (max_tokens, stream)
            assert lps[0] is None and tops[0] is None
            assert torch.allclose(torch.tensor(lps[1 : len(prompt)]), expected, atol=1e-4), (max_tokens, stream)
            for pos, top in enumerate(tops[1 : len(prompt)]):  # keyed by text: ids past the tokenizer's are all ""
                assert top and all((top_values[pos] - v).abs().min() < 1e-4 for v in top.values())
            finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert len(finishes) == 1 and (max_tokens or finishes == ["length"])  # scoring: the budget was 0
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            assert text.startswith(echo) and (max_tokens or text == echo)
            if not stream:
                assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == max_tokens
                assert reply.choices[0].finish_reason == "length"

    # The SDK's result carries them too.
    from splitserve.client import Client
    from splitserve.client import SamplingParams as ClientParams

    with Client(cluster.router) as sdk:
        [result] = sdk.generate([prompt], ClientParams(num_tokens_to_generate=2, temperature=0.0, return_log_probs=True,
                                                       top_n_logprobs=3, return_prompt_log_probs=True))  # fmt: skip
    assert torch.allclose(torch.tensor(result.prompt_log_probs), expected, atol=1e-4)
    assert [list(top) for top in result.prompt_top_logprobs] == top_ids.tolist()

    # Served aggregated: the decode worker computes the prompt (asked directly, as the router does
    # when it serves a request without a prefill worker).
    params = sampling_to_proto(SamplingParams(num_tokens_to_generate=2, temperature=0.0, return_log_probs=True,
                                              top_n_logprobs=3))  # fmt: skip
    params.return_prompt_log_probs = True
    decode = next(w for w in topology(cluster.control_plane).workers if w.role == common_pb2.ROLE_DECODE)
    with grpc.insecure_channel(decode.address) as ch:
        req = decode_worker_pb2.DecodeRequest(request_id="agg-prompt", token_ids=prompt, sampling_params=params)
        chunks = list(decode_worker_pb2_grpc.DecodeWorkerStub(ch).Decode(req, timeout=60))
    got = [c for c in chunks if c.HasField("prompt_logprobs")]
    assert len(got) == 1 and got[0] is chunks[0] and chunks[0].token_ids
    assert torch.allclose(torch.tensor(list(got[0].prompt_logprobs.logprobs)), expected, atol=1e-4)
    tops = got[0].prompt_logprobs.top_logprobs
    assert [[t.token_id for t in pos.top_logprobs] for pos in tops] == top_ids.tolist()
    assert torch.allclose(torch.tensor([[t.logprob for t in pos.top_logprobs] for pos in tops]), top_values, atol=1e-4)
