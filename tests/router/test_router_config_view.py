"""Router config and CLI, the cluster view's snapshots, retry helpers and proto conversions."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest

from splitserve.control_plane.shard_spec import Role
from splitserve.engine.block_hash import hash_blocks
from splitserve.proto.v1 import common_pb2, decode_worker_pb2, handoff_pb2, prefill_worker_pb2, router_pb2
from splitserve.router.cli import DESCRIPTION, EPILOG, build_parser, config_from_args
from splitserve.router.cluster_view import ClusterView, _tiebreak
from splitserve.router.config import RouterConfig
from splitserve.router.messages import GenerateRequest, SamplingParams, Tokens
from splitserve.router.request_run import continuation, is_handoff_reusable
from splitserve.router.service import (
    decode_request_to_proto,
    generate_request_from_proto,
    prefill_result_from_proto,
    status_of,
)
from splitserve.router.snapshot import WorkerState
from splitserve.router.workers import WorkerEndpoint

BS = 4


def endpoint(worker_id: str, role: Role, **fields) -> WorkerEndpoint:
    return WorkerEndpoint(worker_id, "127.0.0.1:1", role, **fields)


def test_config_validation_quotes_the_bad_value():
    assert RouterConfig(control_planes="127.0.0.1:5").control_planes == ("127.0.0.1:5",)
    for fields, bad in (
        ({"listen": "nohost"}, "'nohost'"), ({"block_size": 0}, "got 0"), ({"max_in_flight": -1}, "-1"),
        ({"decode_timeout_s": 0}, "got 0"), ({"control_planes": ("x",)}, "'x'"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=bad):
            RouterConfig(**fields)


def test_cli_flags_build_the_config():
    args = build_parser().parse_args([
        "--control-plane", "127.0.0.1:1", "--control-plane", "127.0.0.1:2", "--policy", "longest_prefix",
        "--routing-alpha", "0.8", "--disagg-min-uncached-tokens", "64", "--enforce-disagg", "--no-kv-events",
        "--block-size", "32", "--max-in-flight", "7",
    ])  # fmt: skip
    config = config_from_args(args)
    assert config.control_planes == ("127.0.0.1:1", "127.0.0.1:2") and config.block_size == 32
    assert (config.policy.policy, config.policy.routing_alpha) == ("longest_prefix", 0.8)
    assert (config.policy.disagg_min_uncached_tokens, config.policy.enforce_disagg) == (64, True)
    assert (config.kv_events, config.max_in_flight) == (False, 7)
    assert config_from_args(build_parser().parse_args([])).control_planes == ("127.0.0.1:50051",)
    assert "router" in DESCRIPTION.lower() and "scored" in EPILOG
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--policy", "round_robin"])


def test_snapshot_skips_draining_and_mismatched_workers_and_counts_load():
    view = ClusterView(BS, max_running_per_worker=4, approximate_ttl_s=60.0, clock=lambda: 0.0)
    view.set_workers({
        "p0": endpoint("p0", Role.PREFILL), "p1": endpoint("p1", Role.PREFILL, is_draining=True),
        "p2": endpoint("p2", Role.PREFILL, kv_block_size=8), "d0": endpoint("d0", Role.DECODE, kv_block_size=BS),
    })  # fmt: skip
    assert set(view.workers) == {"p0", "p1", "d0"}  # p2 hashes with another block size: never routed to
    hashes = hash_blocks(list(range(12)), BS)
    view.record_routed("p0", hashes[:2])  # approximate mode: what was routed counts as cached
    with view.load.track("d0"), view.load.track("d0"):
        snapshot = view.snapshot(hashes, 12)
    assert snapshot.prefill == (WorkerState("p0", 2, 0, 4, tiebreak=_tiebreak(hashes[0], "p0")),)
    assert snapshot.decode == (WorkerState("d0", 0, 2, 4, tiebreak=_tiebreak(hashes[0], "d0")),)
    assert _tiebreak(hashes[0], "p0") != _tiebreak(hashes[0], "d0") != 0
    assert view.snapshot(hashes, 12, exclude=frozenset({"p0"})).prefill == ()
    view.set_workers({"d0": endpoint("d0", Role.DECODE)})
    assert view.index.worker_ids == ()


def test_retry_helpers():
    assert is_handoff_reusable(grpc.StatusCode.UNAVAILABLE, 0, 1e12)
    assert is_handoff_reusable(grpc.StatusCode.UNAVAILABLE, 10_000, 5_000)
    assert not is_handoff_reusable(grpc.StatusCode.UNAVAILABLE, 10_000, 9_500)  # lease about to end
    assert not is_handoff_reusable(grpc.StatusCode.INTERNAL, 10_000, 0)  # may have pulled and released
    request = GenerateRequest("r", (1, 2, 3), SamplingParams(num_tokens_to_generate=5, seed=3))
    follow = continuation(request, Tokens((9,)))
    assert follow.token_ids == (1, 2, 3, 9) and follow.sampling_params == SamplingParams(4, seed=3, output_offset=1)
    again = continuation(follow, Tokens((8, 7)))  # resumed twice: positions go on counting
    assert again.token_ids == (1, 2, 3, 9, 8, 7) and again.sampling_params == SamplingParams(2, seed=3, output_offset=3)
    # Prompt log-probs went out with the first token: neither a continuation nor an import asks again.
    scored = replace(request, sampling_params=SamplingParams(5, return_log_probs=True, return_prompt_log_probs=True))
    assert not continuation(scored, Tokens((9,))).sampling_params.return_prompt_log_probs
    assert decode_request_to_proto(scored, None, None).sampling_params.return_prompt_log_probs  # aggregated: asked
    imported = decode_request_to_proto(scored, handoff_pb2.HandoffDescriptor(request_id="r").SerializeToString(), "p")
    assert not imported.sampling_params.return_prompt_log_probs


def test_proto_conversions_at_the_boundary():
    message = router_pb2.GenerateRequest(
        request_id="r", token_ids=[1, 2], enforce_disagg=False,
        sampling_params=common_pb2.SamplingParams(num_tokens_to_generate=3, seed=0, stop_words=["x"]),
    )  # fmt: skip
    request = generate_request_from_proto(message)
    assert request.enforce_disagg is False and request.sampling_params.seed == 0
    assert request.sampling_params.stop_words == ("x",)
    assert generate_request_from_proto(router_pb2.GenerateRequest(
        request_id="r", token_ids=[1], sampling_params=common_pb2.SamplingParams(num_tokens_to_generate=1),
    )).enforce_disagg is None  # fmt: skip
    with pytest.raises(ValueError, match="sampling_params is required"):
        generate_request_from_proto(router_pb2.GenerateRequest(request_id="r", token_ids=[1]))

    handoff = handoff_pb2.HandoffDescriptor(request_id="r", first_token_id=42, first_token_logprob=-0.25)
    handoff.first_token_top_logprobs.add(token_id=42, logprob=-0.25)
    result = prefill_result_from_proto(prefill_worker_pb2.PrefillResponse(handoff=handoff, num_cached_tokens=4))
    assert result.first == Tokens((42,), (-0.25,), (((42, -0.25),),)) and result.finish_reason is None
    decode = decode_request_to_proto(request, result.handoff, "127.0.0.1:9")
    assert decode.handoff == handoff and decode.prefill_address == "127.0.0.1:9"
    assert not decode_request_to_proto(request, None, None).HasField("handoff")
    with pytest.raises(ValueError, match="no handoff"):
        prefill_result_from_proto(prefill_worker_pb2.PrefillResponse())
    assert decode_worker_pb2.DecodeChunk(num_cached_tokens=3).num_cached_tokens == 3
    assert status_of(RuntimeError("x")) == grpc.StatusCode.INTERNAL
