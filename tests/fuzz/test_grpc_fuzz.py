"""Property-based fuzzing of the gRPC services of a real cluster (`splitserve up`, the embedded model):
the Router, PrefillWorker and DecodeWorker services get hypothesis-generated requests of every
method (any field, any value its type admits, unknown enum values, long token lists).

Properties: every call ends within its deadline with a status that says "your request" or
"not now" — never UNKNOWN / INTERNAL (an unhandled exception in a servicer) or UNIMPLEMENTED —
and afterwards every process still answers SERVING and the cluster still generates.
The default stage runs a few examples per method; `-m slow` runs many more."""

from __future__ import annotations

import shutil

import grpc
import pytest
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.client import Client, ClientOptions, SamplingParams
from splitserve.proto.v1 import decode_worker_pb2, prefill_worker_pb2, router_pb2
from splitserve.router import messages as router_messages
from splitserve.router.messages import GenerateRequest
from splitserve.router.service import (
    decode_request_to_proto,
    prefill_request_to_proto,
    sampling_params_to_proto,
)
from tests.fuzz.proto_strategies import messages, near
from tests.security.up_cluster import UpCluster

if shutil.which("etcd") is None:
    pytest.skip("needs the etcd binary (apt-get install etcd-server)", allow_module_level=True)

FAST_EXAMPLES, SLOW_EXAMPLES = 8, 150
DEADLINE_S = 3.0
MAX_STREAM_CHUNKS = 50
FINE = {
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNAVAILABLE,  # a handoff from a made-up prefill address cannot be pulled
    grpc.StatusCode.DEADLINE_EXCEEDED,  # a valid request for many tokens is long work, not a hang
}  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    work = tmp_path_factory.mktemp("fuzz-up")
    with UpCluster(work, "--worker-arg=--handoff-lease-s=5") as up:
        yield up


VOCAB = 3072  # the embedded model's


def _valid_requests() -> st.SearchStrategy[GenerateRequest]:
    params = st.builds(router_messages.SamplingParams, num_tokens_to_generate=st.integers(1, 8), temperature=st.sampled_from([0.0, 1.0]),
                       top_k=st.integers(0, 50), seed=st.none() | st.integers(0, 2**31))  # fmt: skip
    return st.builds(GenerateRequest, request_id=st.uuids().map(str),
                     token_ids=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=80).map(tuple),
                     sampling_params=params)  # fmt: skip


def _strategy(path: str, request_type):
    """Near-valid requests for the methods whose arbitrary requests never pass validation."""
    valid = {
        "/splitserve.v1.Router/Generate": lambda r: router_pb2.GenerateRequest(
            request_id=r.request_id, token_ids=r.token_ids, sampling_params=sampling_params_to_proto(r.sampling_params)),
        "/splitserve.v1.PrefillWorker/Prefill": lambda r: prefill_request_to_proto(r, "fuzz-decode-worker"),
        "/splitserve.v1.PrefillWorker/PrefillStream": lambda r: prefill_request_to_proto(r, "fuzz-decode-worker"),
        "/splitserve.v1.DecodeWorker/Decode": lambda r: decode_request_to_proto(r, None, None),
    }.get(path)  # fmt: skip
    if valid is None:
        return messages(request_type)
    return near(_valid_requests().map(valid), request_type)


def _methods(module, service: str):
    for method in module.DESCRIPTOR.services_by_name[service].methods:
        yield f"/{method.containing_service.full_name}/{method.name}", GetMessageClass(method.input_type), \
            method.server_streaming  # fmt: skip


def _targets(cluster):
    prefill, decode = cluster.workers  # the default spec: one prefill, then one decode worker
    yield from ((cluster.router, *m) for m in _methods(router_pb2, "Router"))
    yield from ((prefill, *m) for m in _methods(prefill_worker_pb2, "PrefillWorker"))
    yield from ((decode, *m) for m in _methods(decode_worker_pb2, "DecodeWorker"))


def _call(channel: grpc.Channel, path: str, request, is_streaming: bool) -> grpc.StatusCode:
    serialize = type(request).SerializeToString
    try:
        if is_streaming:
            stream = channel.unary_stream(path, request_serializer=serialize)(request, timeout=DEADLINE_S)
            for i, _ in enumerate(stream):
                if i >= MAX_STREAM_CHUNKS:
                    stream.cancel()
                    break
        else:
            channel.unary_unary(path, request_serializer=serialize)(request, timeout=DEADLINE_S)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def _property(channel: grpc.Channel, path: str, request_type, is_streaming: bool, max_examples: int):
    @given(request=_strategy(path, request_type))
    @settings(max_examples=max_examples, deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=True, database=None)  # fmt: skip
    def answers_sensibly(request):
        code = _call(channel, path, request, is_streaming)
        assert code in FINE, f"{path} answered {code} to {request}"

    return answers_sensibly


def _fuzz(cluster, max_examples: int) -> None:
    for address, path, request_type, is_streaming in _targets(cluster):
        with grpc.insecure_channel(address) as channel:
            _property(channel, path, request_type, is_streaming, max_examples)()
    _assert_cluster_healthy(cluster)


def _assert_cluster_healthy(cluster) -> None:
    for address in (cluster.router, *cluster.workers):
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, address
    with Client(cluster.router, options=ClientOptions(timeout_s=30, max_attempts=3)) as sdk:
        [result] = sdk.generate([[3, 4, 5, 6, 7]], SamplingParams(num_tokens_to_generate=4))
        assert len(result.generated_tokens) == 4
    for name in ("router", "prefill-worker-g0-dp0", "decode-worker-g1-dp0"):
        assert "engine loop crashed" not in cluster.log(name), cluster.log(name)[-3000:]


def test_grpc_services_fuzz(cluster):
    _fuzz(cluster, FAST_EXAMPLES)


@pytest.mark.slow
def test_grpc_services_fuzz_long(cluster):
    _fuzz(cluster, SLOW_EXAMPLES)
