"""What the sync and async clients share: request preparation, lifecycle actions, leader redirects."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from splitserve.client.prompts import as_prompt_list, encode, is_single_prompt
from splitserve.client.types import SamplingParams
from splitserve.engine.tokenizer import Tokenizer
from splitserve.proto.v1 import common_pb2, control_plane_pb2

LEADER_ADDRESS_METADATA = "splitserve-leader-address"
"""Trailing metadata a control-plane follower names the leader in (control_plane/service.py)."""

LIFECYCLE_ACTIONS = {
    "pause": control_plane_pb2.LIFECYCLE_ACTION_PAUSE,
    "unpause": control_plane_pb2.LIFECYCLE_ACTION_UNPAUSE,
    "suspend": control_plane_pb2.LIFECYCLE_ACTION_SUSPEND,
    "resume": control_plane_pb2.LIFECYCLE_ACTION_RESUME,
    "reload_weights": control_plane_pb2.LIFECYCLE_ACTION_RELOAD_WEIGHTS,
}


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    token_ids: list[int]
    params: SamplingParams


def new_request_id() -> str:
    return f"sdk-{uuid.uuid4().hex}"


def prepare(
    prompts: object, params: SamplingParams | None, tokenizer: Tokenizer | None, request_ids: Sequence[str] | None
) -> tuple[list[PreparedRequest], bool]:
    """One PreparedRequest per prompt, in input order, and whether `prompts` was a single prompt."""
    params = SamplingParams.coerce(params or SamplingParams())
    prompt_list = as_prompt_list(prompts)
    if request_ids is not None and len(request_ids) != len(prompt_list):
        raise ValueError(f"got {len(request_ids)} request ids for {len(prompt_list)} prompts")
    ids = list(request_ids) if request_ids is not None else [new_request_id() for _ in prompt_list]
    repeated = sorted(rid for rid, n in Counter(ids).items() if n > 1)
    if repeated:  # else the router refuses the second as already running, after the first has started
        raise ValueError(f"request ids must be unique within a call; repeated: {repeated}")
    prepared = [PreparedRequest(rid, encode(p, tokenizer, params.add_BOS), params) for rid, p in zip(ids, prompt_list, strict=True)]
    return prepared, is_single_prompt(prompts)


def abort_request(request_id: str) -> common_pb2.AbortRequest:
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
    return common_pb2.AbortRequest(request_id=request_id)


def lifecycle_request(action: str, checkpoint_path: str | None) -> control_plane_pb2.LifecycleRequest:
    if action == "reload_weights" and not checkpoint_path:
        raise ValueError("reload_weights needs a checkpoint path")
    return control_plane_pb2.LifecycleRequest(action=LIFECYCLE_ACTIONS[action], checkpoint_path=checkpoint_path or "")


def leader_of(error: grpc.RpcError, trailing: object) -> str | None:
    """The leader's address a follower named in its FAILED_PRECONDITION answer, if any."""
    if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return None
    for key, value in trailing or ():
        if key == LEADER_ADDRESS_METADATA and value:
            return value
    return None
