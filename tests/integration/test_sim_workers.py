"""Simulated prefill and decode worker processes (`--engine sim`), driven over gRPC
like the real ones (tests/integration/test_disagg_workers.py): the handoff works,
tokens are deterministic (disaggregated == aggregated on the decode worker), prefix
hits show in num_cached_tokens, the modelled time is spent, and the decode
worker's ack releases the prefill worker's pins."""

import json
import random
import time

import grpc
import pytest

from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.wire import sampling_to_proto
from splitserve.proto.v1 import (
    decode_worker_pb2,
    decode_worker_pb2_grpc,
    prefill_worker_pb2,
    prefill_worker_pb2_grpc,
)
from tests.fixtures.workers import WorkerProcess

VOCAB = 512
BLOCK = 8
NUM_BLOCKS = 128  # the prefill side refuses new work while >= 64 blocks are pinned
PREFILL_TOKENS_PER_S = 4000.0
DECODE_STEP_S = 0.005
SIM_FLAGS = [
    "--engine", "sim", "--block-size", str(BLOCK), "--num-blocks", str(NUM_BLOCKS), "--max-tokens", "1024",
    "--sim-prefill-tokens-per-s", str(PREFILL_TOKENS_PER_S), "--sim-decode-step-s", str(DECODE_STEP_S),
    "--handoff-lease-s", "60", "--grace-s", "2",
]  # fmt: skip
PARAMS = sampling_to_proto(SamplingParams(num_tokens_to_generate=12, temperature=0.0, return_log_probs=True))

# Only the shape is read: a 2-layer Llama with 2 kv heads of 16 dims, bfloat16, 512 tokens.
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
    "max_position_embeddings": 1024, "torch_dtype": "bfloat16",
}  # fmt: skip


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    model = tmp_path_factory.mktemp("sim-model")
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
    prefill = WorkerProcess("prefill-worker", str(model), *SIM_FLAGS)
    try:
        decode = WorkerProcess("decode-worker", str(model), *SIM_FLAGS)
    except BaseException:
        prefill.kill()
        raise
    with grpc.insecure_channel(prefill.address) as pc, grpc.insecure_channel(decode.address) as dc:
        yield prefill.address, prefill_worker_pb2_grpc.PrefillWorkerStub(pc), decode_worker_pb2_grpc.DecodeWorkerStub(dc)
    codes = [worker.stop() for worker in (prefill, decode)]
    for worker in (prefill, decode):
        worker.kill()
    assert codes == [0, 0], "".join(prefill.log + decode.log)  # drained: nothing left pinned or running


def random_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def prefill(stub, request_id, prompt):
    request = prefill_worker_pb2.PrefillRequest(request_id=request_id, token_ids=prompt, sampling_params=PARAMS)
    return stub.Prefill(request, timeout=30)


def decode(stub, request_id, prompt, handoff=None, prefill_address=""):
    request = decode_worker_pb2.DecodeRequest(
        request_id=request_id, token_ids=prompt, sampling_params=PARAMS, prefill_address=prefill_address
    )
    if handoff is not None:
        request.handoff.CopyFrom(handoff)
    tokens, logprobs, finish = [], [], None
    for chunk in stub.Decode(request, timeout=30):
        tokens += chunk.token_ids
        logprobs += chunk.logprobs
        finish = chunk.finish_reason
    return tokens, logprobs, finish


def release(stub, request_id) -> bool:
    return stub.Release(prefill_worker_pb2.ReleaseRequest(request_id=request_id), timeout=10).was_pinned


def test_disaggregated_tokens_equal_aggregated_on_the_decode_worker(workers):
    prefill_address, prefill_stub, decode_stub = workers
    for i, n in enumerate((5, 29, 40)):
        prompt = random_prompt(i, n)
        response = prefill(prefill_stub, f"d{i}", prompt)
        handoff = response.handoff
        num_blocks = -(-n // BLOCK)
        assert (handoff.layout.tp, handoff.layout.num_layers, handoff.layout.num_kv_heads) == (1, 2, 2)
        assert (handoff.layout.head_dim, handoff.layout.dtype, handoff.layout.block_size) == (16, "bfloat16", BLOCK)
        assert handoff.model_fingerprint.startswith("sim-") and handoff.num_tokens == n
        assert list(handoff.block_checksums) == [0] * num_blocks  # there is no KV to sum
        disagg = decode(decode_stub, f"d{i}", prompt, handoff, prefill_address)
        aggregated = decode(decode_stub, f"a{i}", prompt)  # no handoff: the decode worker prefills itself
        assert disagg == aggregated
        tokens, logprobs, finish = disagg
        assert len(tokens) == len(logprobs) == 12 and finish != 0
        assert tokens[0] == handoff.first_token_id and all(0 <= t < VOCAB for t in tokens)
        assert not release(prefill_stub, f"d{i}")  # the decode worker's ack came first


def test_prefix_hits_show_in_num_cached_tokens_and_skip_modelled_time(workers):
    _, prefill_stub, _ = workers
    prompt = random_prompt(10, 400)
    start = time.monotonic()
    first = prefill(prefill_stub, "p0", prompt)
    assert time.monotonic() - start >= 400 / PREFILL_TOKENS_PER_S  # 0.1 s of modelled prefill
    assert first.num_cached_tokens == 0
    assert release(prefill_stub, "p0")  # nobody pulled it: pinned until now; its blocks stay cached
    again = prefill(prefill_stub, "p1", prompt)
    assert again.num_cached_tokens == 392  # 49 full blocks; the last token is always computed
    assert again.handoff.first_token_id == first.handoff.first_token_id
    assert release(prefill_stub, "p1")
    shared = prefill(prefill_stub, "p2", prompt[:100] + random_prompt(11, 30))
    assert shared.num_cached_tokens == 96  # the 12 blocks fully inside the shared 100 tokens
    assert release(prefill_stub, "p2")


def test_pins_are_released_when_the_decode_worker_acks(workers):
    prefill_address, prefill_stub, decode_stub = workers
    probe = random_prompt(20, 6)
    big = random_prompt(21, NUM_BLOCKS // 2 * BLOCK)  # pins 64 blocks: the pinned budget is full
    handoff = prefill(prefill_stub, "big", big).handoff
    with pytest.raises(grpc.RpcError) as refused:
        prefill(prefill_stub, "probe", probe)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    start = time.monotonic()
    tokens, _, _ = decode(decode_stub, "big", big, handoff, prefill_address)
    assert len(tokens) == 12 and time.monotonic() - start >= 11 * DECODE_STEP_S
    deadline = time.monotonic() + 5  # the ack is sent as the import finishes; the lease is 60 s
    while True:
        try:
            prefill(prefill_stub, "probe", probe)
            break
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    assert not release(prefill_stub, "big")
    assert release(prefill_stub, "probe")
