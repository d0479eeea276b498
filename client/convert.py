"""Protobuf ↔ SDK types: the one place the SDK converts, plus the per-request result builder."""

from __future__ import annotations

import time

from splitserve.client.types import (
    ClusterTopology,
    FinishReason,
    GenerateResult,
    LifecycleState,
    LifecycleStatus,
    RoutingInfo,
    SamplingParams,
    SlotInfo,
    StreamChunk,
    TimingInfo,
    Usage,
    WorkerInfo,
)
from splitserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from splitserve.proto.v1 import common_pb2, control_plane_pb2, router_pb2

_FINISH = {
    common_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    common_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    common_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
}
_STATE = {
    control_plane_pb2.LIFECYCLE_STATE_RUNNING: LifecycleState.RUNNING,
    control_plane_pb2.LIFECYCLE_STATE_PAUSED: LifecycleState.PAUSED,
    control_plane_pb2.LIFECYCLE_STATE_SUSPENDED: LifecycleState.SUSPENDED,
}
_ROLE = {common_pb2.ROLE_PREFILL: "prefill", common_pb2.ROLE_DECODE: "decode"}


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    message = common_pb2.SamplingParams(
        num_tokens_to_generate=params.num_tokens_to_generate, temperature=params.temperature, top_k=params.top_k,
        top_p=params.top_p, termination_ids=[] if params.termination_id is None else [params.termination_id],
        stop_words=list(params.stop_words), return_log_probs=params.return_log_probs,
        top_n_logprobs=params.top_n_logprobs, output_offset=params.output_offset,
        logit_bias=dict(params.logit_bias), presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, return_prompt_log_probs=params.return_prompt_log_probs,
        json_schema=params.json_schema or "", grammar=params.grammar or "",
    )  # fmt: skip
    if params.seed is not None:
        message.seed = params.seed
    return message


def generate_request_to_proto(
    request_id: str, token_ids: list[int], params: SamplingParams, return_timing: bool
) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        request_id=request_id, token_ids=token_ids, sampling_params=sampling_params_to_proto(params),
        return_timing=return_timing,
    )  # fmt: skip


def lifecycle_from_proto(message: control_plane_pb2.LifecycleStatus) -> LifecycleStatus:
    return LifecycleStatus(
        state=_STATE.get(message.state, LifecycleState.UNKNOWN), weights_version=message.weights_version,
        checkpoint_path=message.checkpoint_path or None,
    )  # fmt: skip


def topology_from_proto(message: control_plane_pb2.Topology) -> ClusterTopology:
    slots = tuple(
        SlotInfo(
            slot_id=s.slot.slot_id, group_index=s.slot.group_index, role=_ROLE.get(s.slot.role, "unspecified"),
            dp_replica=s.slot.dp_replica, tp_rank=s.slot.tp_rank, pp_rank=s.slot.pp_rank, tp=s.slot.tp,
            pp=s.slot.pp, worker_id=s.worker_id or None,
        )  # fmt: skip
        for s in message.slots
    )
    workers = tuple(
        WorkerInfo(w.worker_id, w.address, _ROLE.get(w.role), tuple(w.slot_ids), w.is_draining) for w in message.workers
    )
    return ClusterTopology(
        revision=message.revision, inference_shards=message.inference_shards,
        lifecycle=lifecycle_from_proto(message.lifecycle), slots=slots, workers=workers,
        leader_address=message.leader_address or None,
    )  # fmt: skip


class ResultBuilder:
    """Folds one Generate stream into StreamChunks and the final GenerateResult.

    Not thread-safe; one per request. Text is produced only with a tokenizer.
    """

    def __init__(self, request_id: str, prompt_ids: list[int], tokenizer: Tokenizer | None) -> None:
        self.request_id = request_id
        self._prompt_ids = tuple(prompt_ids)
        self._tokenizer = tokenizer
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids) if tokenizer is not None else None
        self._started = time.monotonic()
        self._ttft: float | None = None
        self._token_ids: list[int] = []
        self._logprobs: list[float] = []
        self._top: list[dict[int, float]] = []
        self._prompt: tuple[tuple[float, ...], tuple[dict[int, float], ...]] | None = None
        self.is_resumed = False
        """Messages now come from a resumed request (client/resume.py): its usage counts the
        received tokens as prompt; the result counts them as generated."""

    @property
    def token_ids(self) -> list[int]:
        """The tokens received so far (all tries)."""
        return self._token_ids

    def add(self, message: router_pb2.GenerateChunk) -> StreamChunk:
        """The chunk for one stream message; the last one (finish_reason set) carries the result."""
        if message.token_ids and self._ttft is None:
            self._ttft = time.monotonic() - self._started
        top = tuple({t.token_id: t.logprob for t in position.top_logprobs} for position in message.top_logprobs)
        text = "".join(self._detokenizer.add(t) for t in message.token_ids) if self._detokenizer else ""
        self._token_ids += message.token_ids
        self._logprobs += message.logprobs
        self._top += top
        prompt = None
        if message.HasField("prompt_logprobs"):
            m = message.prompt_logprobs
            prompt = self._prompt = (tuple(m.logprobs),
                                     tuple({t.token_id: t.logprob for t in pos.top_logprobs} for pos in m.top_logprobs))
        result = self._result(message) if message.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED else None
        return StreamChunk(self.request_id, tuple(message.token_ids), text, tuple(message.logprobs), top,
                           prompt[0] if prompt else None, prompt[1] if prompt else (), result)  # fmt: skip

    def _result(self, message: router_pb2.GenerateChunk) -> GenerateResult:
        if self.is_resumed:
            usage = Usage(len(self._prompt_ids), len(self._token_ids),
                          min(message.usage.cached_tokens, len(self._prompt_ids)))
        else:
            usage = Usage(
                message.usage.prompt_tokens or len(self._prompt_ids),
                message.usage.completion_tokens or len(self._token_ids), message.usage.cached_tokens,
            )  # fmt: skip
        routing = None
        if message.HasField("routing"):
            r = message.routing
            routing = RoutingInfo(
                prefill_worker_id=r.prefill_worker_id or None, decode_worker_id=r.decode_worker_id,
                predicted_cached_tokens=r.predicted_cached_tokens, reason=r.reason,
                num_prefill_attempts=r.num_prefill_attempts, num_decode_attempts=r.num_decode_attempts,
                num_transfer_blocks=r.num_transfer_blocks,
            )  # fmt: skip
        timing = None
        if message.HasField("timing"):
            t = message.timing
            timing = TimingInfo(t.route_ms, t.prefill_ms, t.time_to_first_token_ms, t.total_ms)
        text = self._tokenizer.decode(self._token_ids) if self._tokenizer is not None else None
        return GenerateResult(
            request_id=self.request_id, prompt_tokens=self._prompt_ids, generated_tokens=tuple(self._token_ids),
            generated_text=text, finish_reason=_FINISH[message.finish_reason], usage=usage,
            generated_log_probs=tuple(self._logprobs), top_n_logprobs=tuple(self._top), routing=routing,
            timing=timing, ttft=self._ttft, prompt_log_probs=self._prompt[0] if self._prompt else None,
            prompt_top_logprobs=self._prompt[1] if self._prompt and self._prompt[1] else None,
        )  # fmt: skip
