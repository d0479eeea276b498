"""The Router gRPC service, and the one place the router converts protobuf to its dataclasses.

Inbound (Router API) and outbound (PrefillWorker / DecodeWorker calls, KV
event payloads, GetBlockSet answers) conversions are all here; the rest of
the router sees messages.py types only. Errors map to status codes as
follows:

    OverloadedError          RESOURCE_EXHAUSTED  (max in flight, or every worker full)
    NoWorkersError           UNAVAILABLE
    DisaggRequiredError      FAILED_PRECONDITION (enforce_disagg, no prefill worker)
    other RoutingError       UNAVAILABLE         (e.g. every prefill attempt failed under enforce_disagg)
    DuplicateRequestError    ALREADY_EXISTS
    bad request fields       INVALID_ARGUMENT
    WorkerCallError          the worker's code if the request was bad, else UNAVAILABLE
"""

from __future__ import annotations

import contextlib

import grpc
from google.protobuf.message import DecodeError
from opentelemetry import context as otel_context

from splitserve.proto.v1 import (
    common_pb2,
    decode_worker_pb2,
    kv_events_pb2,
    prefill_worker_pb2,
    router_pb2,
    router_pb2_grpc,
)
from splitserve.router.messages import (
    AllBlocksCleared,
    BlockSetSnapshot,
    BlocksRemoved,
    BlocksStored,
    DecodeOutput,
    DecodeTiming,
    FinishReason,
    GenerateRequest,
    KVEvent,
    OutputChunk,
    PrefillFirstToken,
    PrefillResult,
    PrefillTiming,
    PromptLogprobs,
    SamplingParams,
    Tokens,
    WorkerCallError,
)
from splitserve.router.orchestrator import DuplicateRequestError, Orchestrator
from splitserve.router.policy import DisaggRequiredError, NoWorkersError, OverloadedError, RoutingError
from splitserve.telemetry.spans import FIRST_MESSAGE, detach_quietly, mark_error, start_server_span

_FINISH_FROM_PROTO = {
    common_pb2.FINISH_REASON_UNSPECIFIED: None,
    common_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    common_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    common_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
}
_FINISH_TO_PROTO = {v: k for k, v in _FINISH_FROM_PROTO.items()}


# ------------------------------------------------------------------ sampling
def sampling_params_from_proto(message: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        num_tokens_to_generate=message.num_tokens_to_generate, temperature=message.temperature,
        top_k=message.top_k, top_p=message.top_p, seed=message.seed if message.HasField("seed") else None,
        termination_ids=tuple(message.termination_ids), stop_words=tuple(message.stop_words),
        return_log_probs=message.return_log_probs, top_n_logprobs=message.top_n_logprobs,
        output_offset=message.output_offset, logit_bias=tuple(sorted(message.logit_bias.items())),
        presence_penalty=message.presence_penalty, frequency_penalty=message.frequency_penalty,
        return_prompt_log_probs=message.return_prompt_log_probs, json_schema=message.json_schema,
        grammar=message.grammar,
    )  # fmt: skip


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        num_tokens_to_generate=params.num_tokens_to_generate, temperature=params.temperature,
        top_k=params.top_k, top_p=params.top_p, seed=params.seed, termination_ids=params.termination_ids,
        stop_words=params.stop_words, return_log_probs=params.return_log_probs,
        top_n_logprobs=params.top_n_logprobs, output_offset=params.output_offset,
        logit_bias=dict(params.logit_bias), presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, return_prompt_log_probs=params.return_prompt_log_probs,
        json_schema=params.json_schema, grammar=params.grammar,
    )  # fmt: skip


def _tops_from_proto(top_logprobs) -> tuple[tuple[tuple[int, float], ...], ...]:
    return tuple(tuple((t.token_id, t.logprob) for t in position.top_logprobs) for position in top_logprobs)


def _prompt_from_proto(message) -> PromptLogprobs | None:
    """A worker message's `prompt_logprobs` field (None when absent)."""
    if not message.HasField("prompt_logprobs"):
        return None
    prompt = message.prompt_logprobs
    return PromptLogprobs(tuple(prompt.logprobs), _tops_from_proto(prompt.top_logprobs))


def _tokens_from_proto(token_ids, logprobs, top_logprobs, prompt: PromptLogprobs | None = None) -> Tokens:
    return Tokens(tuple(token_ids), tuple(logprobs), _tops_from_proto(top_logprobs), prompt)


def _top_logprobs_to_proto(tops) -> list[common_pb2.TokenTopLogprobs]:
    return [
        common_pb2.TokenTopLogprobs(top_logprobs=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in position])
        for position in tops
    ]


# ------------------------------------------------------------------ Router API
def generate_request_from_proto(message: router_pb2.GenerateRequest) -> GenerateRequest:
    """Raises ValueError (quoting the bad value) for an invalid request."""
    if not message.HasField("sampling_params"):
        raise ValueError("sampling_params is required (num_tokens_to_generate at least)")
    return GenerateRequest(
        request_id=message.request_id,
        token_ids=tuple(message.token_ids),
        sampling_params=sampling_params_from_proto(message.sampling_params),
        return_timing=message.return_timing,
        enforce_disagg=message.enforce_disagg if message.HasField("enforce_disagg") else None,
    )


def chunk_to_proto(chunk: OutputChunk) -> router_pb2.GenerateChunk:
    tokens = chunk.tokens
    message = router_pb2.GenerateChunk(
        token_ids=tokens.token_ids, logprobs=tokens.logprobs, top_logprobs=_top_logprobs_to_proto(tokens.top_logprobs),
        finish_reason=_FINISH_TO_PROTO[chunk.finish_reason],
    )  # fmt: skip
    if tokens.prompt is not None:
        message.prompt_logprobs.CopyFrom(common_pb2.PromptLogprobs(
            logprobs=tokens.prompt.logprobs, top_logprobs=_top_logprobs_to_proto(tokens.prompt.top_logprobs)))
    if chunk.usage is not None:
        u = chunk.usage
        message.usage.CopyFrom(router_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens, cached_tokens=u.cached_tokens))
    if chunk.routing is not None:
        r = chunk.routing
        message.routing.CopyFrom(router_pb2.RoutingSummary(
            prefill_worker_id=r.prefill_worker_id or "", decode_worker_id=r.decode_worker_id,
            predicted_cached_tokens=r.predicted_cached_tokens, reason=r.reason,
            num_prefill_attempts=r.num_prefill_attempts, num_decode_attempts=r.num_decode_attempts,
            num_transfer_blocks=r.num_transfer_blocks,
        ))  # fmt: skip
    if chunk.timing is not None:
        t = chunk.timing
        message.timing.CopyFrom(router_pb2.TimingSummary(
            route_ms=t.route_ms, prefill_ms=t.prefill_ms, time_to_first_token_ms=t.time_to_first_token_ms,
            total_ms=t.total_ms, trace_id=t.trace_id, kv_transfer_bytes=t.kv_transfer_bytes,
            kv_transfer_gbps=t.kv_transfer_gbps,
            phases=[router_pb2.TimingPhase(name=p.name, ms=p.ms, is_ttft=p.is_ttft) for p in t.phases],
        ))  # fmt: skip
    return message


# ----------------------------------------------------------------- worker API
def prefill_request_to_proto(
    request: GenerateRequest, decode_worker_id: str, decode_tp: int = 0
) -> prefill_worker_pb2.PrefillRequest:
    return prefill_worker_pb2.PrefillRequest(
        request_id=request.request_id, token_ids=request.token_ids,
        sampling_params=sampling_params_to_proto(request.sampling_params), decode_worker_id=decode_worker_id,
        decode_tp=decode_tp,
    )  # fmt: skip


def first_token_from_proto(message: prefill_worker_pb2.PrefillFirstToken) -> PrefillFirstToken:
    first = _first_tokens(message.token_id, message.logprob if message.HasField("logprob") else None, message.top_logprobs,
                          _prompt_from_proto(message))  # fmt: skip
    return PrefillFirstToken(first, _FINISH_FROM_PROTO.get(message.finish_reason))


def prefill_result_from_proto(message: prefill_worker_pb2.PrefillResponse, first: Tokens | None = None) -> PrefillResult:
    """`first`: PrefillStream's first-token event, else the token is read from the handoff. Raises
    ValueError when the reply has no first token, or neither a handoff nor a finish reason."""
    has_handoff = message.HasField("handoff")
    finish_reason = _FINISH_FROM_PROTO.get(message.finish_reason)
    handoff = message.handoff
    if first is None:
        if not has_handoff:
            raise ValueError("PrefillResponse has no handoff (and so no first token)")
        logprob = handoff.first_token_logprob if handoff.HasField("first_token_logprob") else None
        first = _first_tokens(handoff.first_token_id, logprob, handoff.first_token_top_logprobs)
    elif not has_handoff and finish_reason is None:
        raise ValueError("PrefillResponse has neither a handoff nor a finish reason")
    timing = None
    if message.HasField("timing"):
        t = message.timing
        timing = PrefillTiming(t.handler_ms, t.queue_ms, t.compute_ms, t.publish_ms, t.num_chunks, t.first_token_ms)
    return PrefillResult(
        first=first, num_cached_tokens=message.num_cached_tokens, finish_reason=finish_reason,
        handoff=handoff.SerializeToString() if has_handoff else b"", lease_deadline_unix_ms=handoff.lease_deadline_unix_ms,
        timing=timing,
    )  # fmt: skip


def _first_tokens(token_id: int, logprob: float | None, top_logprobs, prompt: PromptLogprobs | None = None) -> Tokens:
    """The one-entry Tokens of a prefill's first token (top_logprobs: TopLogprob messages, maybe none)."""
    tops = (tuple((t.token_id, t.logprob) for t in top_logprobs),) if top_logprobs else ()
    return Tokens((token_id,), () if logprob is None else (logprob,), tops, prompt)


def decode_request_to_proto(
    request: GenerateRequest, handoff: bytes | None, prefill_address: str | None
) -> decode_worker_pb2.DecodeRequest:
    message = decode_worker_pb2.DecodeRequest(
        request_id=request.request_id, token_ids=request.token_ids,
        sampling_params=sampling_params_to_proto(request.sampling_params), prefill_address=prefill_address or "",
    )  # fmt: skip
    if handoff is not None:
        message.handoff.ParseFromString(handoff)
        message.sampling_params.return_prompt_log_probs = False  # the prefill worker sent them
    return message


def decode_output_from_proto(message: decode_worker_pb2.DecodeChunk) -> DecodeOutput:
    tokens = _tokens_from_proto(message.token_ids, message.logprobs, message.top_logprobs, _prompt_from_proto(message))
    timing = None
    if message.HasField("timing"):
        t = message.timing
        timing = DecodeTiming(
            t.queue_ms, t.prefill_ms, t.transfer_ms, t.transfer_bytes, t.transfer_seconds, t.transport,
            t.first_step_ms, t.first_chunk_ms, t.stream_ms, t.prefetched,
        )  # fmt: skip
    return DecodeOutput(tokens, _FINISH_FROM_PROTO.get(message.finish_reason), message.num_cached_tokens, timing)


def block_set_from_proto(message: prefill_worker_pb2.BlockSet) -> BlockSetSnapshot:
    return BlockSetSnapshot(frozenset(message.block_digests), message.block_size, message.event_sequence)


def kv_events_from_bytes(payload: bytes) -> tuple[KVEvent, ...]:
    """The events of one KVEventBatch payload; ValueError if it does not parse."""
    batch = kv_events_pb2.KVEventBatch()
    try:
        batch.ParseFromString(payload)
    except DecodeError as e:
        raise ValueError(f"not a KVEventBatch: {e}") from e
    events: list[KVEvent] = []
    for event in batch.events:
        kind = event.WhichOneof("event")
        if kind == "stored":
            s = event.stored
            events.append(BlocksStored(tuple(s.block_hashes), s.parent_hash or None, s.block_size))
        elif kind == "removed":
            events.append(BlocksRemoved(tuple(event.removed.block_hashes)))
        elif kind == "all_cleared":
            events.append(AllBlocksCleared())
    return tuple(events)


# -------------------------------------------------------------------- servicer
_ERROR_CODES = (
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NoWorkersError, grpc.StatusCode.UNAVAILABLE),
    (DisaggRequiredError, grpc.StatusCode.FAILED_PRECONDITION),
    (DuplicateRequestError, grpc.StatusCode.ALREADY_EXISTS),
    (RoutingError, grpc.StatusCode.UNAVAILABLE),
)


def status_of(error: Exception) -> grpc.StatusCode:
    """The status code a Generate failure ends the call with (table in the module docstring)."""
    if isinstance(error, WorkerCallError):
        return error.code if error.is_request_error else grpc.StatusCode.UNAVAILABLE
    for kind, code in _ERROR_CODES:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


class RouterService(router_pb2_grpc.RouterServicer):
    """gRPC face of the orchestrator."""

    def __init__(self, orchestrator: Orchestrator) -> None:
        self._orchestrator = orchestrator

    async def Generate(self, request, context):
        # The caller's traceparent (gateway, SDK or any client) makes this span its child.
        span, span_context = start_server_span("router.generate", context.invocation_metadata(), {
            "rpc.system": "grpc", "rpc.service": "splitserve.v1.Router", "rpc.method": "Generate",
            "splitserve.request_id": request.request_id,
        })  # fmt: skip
        token = otel_context.attach(span_context)  # this task's: logs and child spans see it
        is_first = True
        try:
            try:
                generate_request = generate_request_from_proto(request)
            except ValueError as e:
                mark_error(span, e)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            try:
                # aclosing: a cancelled call (client gone) runs the orchestrator's clean-up (Abort to
                # the workers, metrics, span attributes) now, inside this span, not when GC finds it.
                async with contextlib.aclosing(self._orchestrator.generate(generate_request)) as chunks:
                    async for chunk in chunks:
                        if is_first:
                            is_first = False
                            span.add_event(FIRST_MESSAGE)
                        yield chunk_to_proto(chunk)
            except (RoutingError, DuplicateRequestError, WorkerCallError) as e:
                mark_error(span, e)
                await context.abort(status_of(e), str(e))
        finally:
            span.end()
            detach_quietly(token)

    async def Abort(self, request, context):
        was_found = await self._orchestrator.abort(request.request_id)
        return common_pb2.AbortResponse(was_found=was_found)
