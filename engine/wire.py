"""Proto ↔ engine dataclasses for the worker services — the one place they convert.

Both worker services speak the same messages (sampling params, handoff
descriptors, output chunks, torch_dist push requests) and may not import each other, so the conversion
lives here, beside the dataclasses it produces.
"""

from __future__ import annotations

from splitserve.engine.handoff import HandoffDescriptor, RankEndpoint
from splitserve.engine.handoff_push_messages import PushGrant, PushRequest, StatePush
from splitserve.engine.request import GenerationResult
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.state_handoff import StateHandoff
from splitserve.engine.transfer.layout import KVLayout
from splitserve.engine.transfer.state_plan import StateLayout
from splitserve.proto.v1 import common_pb2, handoff_pb2, prefill_worker_pb2


class EndpointInterner:
    """Hands back the bytes object seen last under a key when new bytes are equal to it.

    A decode worker parses every request's descriptor afresh, so each pull would get its source
    endpoints as new bytes objects — and the transports find their mapped pools, parsed
    endpoints and NIXL agents by that metadata (dict lookups: hashing ~13 KB of a 16-layer VRAM
    endpoint cost ~4 µs on this 2-core machine, ~15 µs at 64 KB, per pull; a 1k-token GPU pull
    is ~30 µs). Equal bytes from the same (address, rank) are the rule — a worker's endpoint
    changes only when its pool is exposed again — and comparing them is a memcmp (~0.3 µs at
    13 KB), after which the reused object's cached hash makes every lookup O(1). New or changed
    metadata is kept as the key's latest. At most `limit` keys (then it starts over): a decode
    worker pulls from a few dozen prefill ranks, and 256 endpoints of an 80-layer model's ~64 KB
    are ~16 MB held."""

    def __init__(self, limit: int = 256) -> None:
        self._limit = limit
        self._last: dict[tuple, bytes] = {}

    def __call__(self, key: tuple, data: bytes) -> bytes:
        last = self._last.get(key)
        if last is not None and last == data:
            return last
        if len(self._last) >= self._limit:
            self._last.clear()
        self._last[key] = data
        return data


_ENDPOINTS = EndpointInterner()

FINISH_REASONS = {
    "stopped": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "aborted": common_pb2.FINISH_REASON_ABORT,
}


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError (quoting the value) for invalid settings."""
    if len(msg.termination_ids) > 1:
        raise ValueError(f"at most one termination id is supported, got {list(msg.termination_ids)}")
    if msg.return_prompt_log_probs and not msg.return_log_probs:
        raise ValueError("return_prompt_log_probs needs return_log_probs, got return_log_probs=False")
    return SamplingParams(
        num_tokens_to_generate=msg.num_tokens_to_generate or 16,
        temperature=float(msg.temperature),
        top_k=msg.top_k,
        top_p=float(msg.top_p),
        seed=msg.seed if msg.HasField("seed") else None,
        termination_id=msg.termination_ids[0] if msg.termination_ids else None,
        stop_words=tuple(msg.stop_words),
        return_log_probs=msg.return_log_probs,
        skip_prompt_log_probs=not msg.return_prompt_log_probs,
        top_n_logprobs=msg.top_n_logprobs,
        output_offset=msg.output_offset,
        logit_bias={token: _exact(bias) for token, bias in msg.logit_bias.items()},
        presence_penalty=_exact(msg.presence_penalty),
        frequency_penalty=_exact(msg.frequency_penalty),
        json_schema=msg.json_schema or None,
        grammar=msg.grammar or None,
    )


def _exact(value: float) -> float:
    """A float32 proto field back as the decimal it was sent as (2.0 stays 2.0, 0.1 is 0.1, not
    0.10000000149…), so range checks and sampling see the client's number."""
    return float(f"{value:.7g}")


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    """The engine params as the wire's. The wire asks for prompt log-probs only explicitly
    (`return_prompt_log_probs`): the engine's `return_log_probs` alone implies them, and they
    cost a prefix-cache miss, so they are not carried over here; set the field to ask."""
    msg = common_pb2.SamplingParams(
        num_tokens_to_generate=p.num_tokens_to_generate or 0,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        termination_ids=[] if p.termination_id is None else [p.termination_id],
        stop_words=list(p.stop_words),
        return_log_probs=p.return_log_probs,
        top_n_logprobs=p.top_n_logprobs,
        output_offset=p.output_offset,
        logit_bias=dict(p.logit_bias),
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        json_schema=p.json_schema or "",
        grammar=p.grammar or "",
    )
    if p.seed is not None:
        msg.seed = p.seed
    return msg


def finish_reason(result: GenerationResult) -> int:
    return FINISH_REASONS.get(result.status, common_pb2.FINISH_REASON_UNSPECIFIED)


def top_logprobs_to_proto(top: dict[int, float]) -> common_pb2.TokenTopLogprobs:
    return common_pb2.TokenTopLogprobs(
        top_logprobs=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in top.items()]
    )


def prompt_logprobs_to_proto(result: GenerationResult) -> common_pb2.PromptLogprobs | None:
    """A result's prompt log-probs (None when its request did not ask for them)."""
    if result.prompt_log_probs is None:
        return None
    return common_pb2.PromptLogprobs(
        logprobs=result.prompt_log_probs,
        top_logprobs=[top_logprobs_to_proto(top) for top in result.prompt_top_logprobs or ()],
    )


def layout_to_proto(layout: KVLayout) -> handoff_pb2.KVLayout:
    return handoff_pb2.KVLayout(
        dtype=layout.dtype,
        block_size=layout.block_size,
        tp=layout.tp,
        pp=layout.pp,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        layer_ranges=[handoff_pb2.LayerRange(start=s, end=e) for s, e in layout.layer_ranges],
    )


def layout_from_proto(lay: handoff_pb2.KVLayout) -> KVLayout:
    """Raises ValueError for an invalid layout."""
    return KVLayout(
        dtype=lay.dtype,
        block_size=lay.block_size,
        tp=lay.tp,
        pp=lay.pp,
        num_layers=lay.num_layers,
        num_kv_heads=lay.num_kv_heads,
        head_dim=lay.head_dim,
        layer_ranges=tuple((r.start, r.end) for r in lay.layer_ranges),
    )


def state_layout_to_proto(layout: StateLayout) -> handoff_pb2.StateLayout:
    return handoff_pb2.StateLayout(
        tp=layout.tp,
        pp=layout.pp,
        num_layers=layout.num_layers,
        layer_ranges=[handoff_pb2.LayerRange(start=s, end=e) for s, e in layout.layer_ranges],
        num_heads=layout.num_heads,
        head_dim=layout.head_dim,
        num_groups=layout.num_groups,
        state_size=layout.state_size,
        conv_width=layout.conv_width,
        conv_dtype=layout.conv_dtype,
        ssm_dtype=layout.ssm_dtype,
    )


def state_layout_from_proto(lay: handoff_pb2.StateLayout) -> StateLayout:
    """Raises ValueError for an invalid layout."""
    sizes = {"tp": lay.tp, "pp": lay.pp, "num_heads": lay.num_heads, "head_dim": lay.head_dim,
             "num_groups": lay.num_groups, "state_size": lay.state_size, "conv_width": lay.conv_width}
    if bad := {k: v for k, v in sizes.items() if v < 1}:
        raise ValueError(f"recurrent-state layout sizes must be >= 1, got {bad}")
    return StateLayout(
        tp=lay.tp,
        pp=lay.pp,
        num_layers=lay.num_layers,
        layer_ranges=tuple((r.start, r.end) for r in lay.layer_ranges),
        num_heads=lay.num_heads,
        head_dim=lay.head_dim,
        num_groups=lay.num_groups,
        state_size=lay.state_size,
        conv_width=lay.conv_width,
        conv_dtype=lay.conv_dtype,
        ssm_dtype=lay.ssm_dtype,
    )


def state_to_proto(h: StateHandoff) -> handoff_pb2.StateHandoff:
    return handoff_pb2.StateHandoff(
        layout=state_layout_to_proto(h.layout),
        slot=h.slot,
        checksum=h.checksum,
        endpoints=[handoff_pb2.StateEndpoint(rank=r, data=data) for r, data in sorted(h.endpoints.items())],
    )


def state_from_proto(msg: handoff_pb2.StateHandoff, addresses: dict[int, str] | None = None) -> StateHandoff:
    """Raises ValueError for a malformed state handoff. `addresses`: the KV endpoints' addresses by
    rank (they key the endpoint interning; the state endpoint has none of its own)."""
    addresses = addresses or {}
    if msg.slot < 0:
        raise ValueError(f"state slot must be >= 0, got {msg.slot!r}")
    return StateHandoff(
        layout=state_layout_from_proto(msg.layout),
        slot=msg.slot,
        checksum=msg.checksum,
        endpoints={e.rank: _ENDPOINTS(("state", addresses.get(e.rank, ""), e.rank), e.data) for e in msg.endpoints},
    )


def descriptor_to_proto(d: HandoffDescriptor) -> handoff_pb2.HandoffDescriptor:
    msg = handoff_pb2.HandoffDescriptor(
        request_id=d.request_id,
        model_fingerprint=d.model_fingerprint,
        layout=layout_to_proto(d.layout),
        rank_blocks=[handoff_pb2.RankBlocks(rank=r, block_ids=ids) for r, ids in sorted(d.rank_block_ids.items())],
        num_tokens=d.num_tokens,
        transport_kind=d.transport_kind,
        rank_endpoints=[
            handoff_pb2.RankEndpoint(rank=e.rank, address=e.address, agent_metadata=e.agent_metadata)
            for _, e in sorted(d.endpoints.items())
        ],
        first_token_id=d.first_token_id,
        first_token_top_logprobs=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in d.first_token_top_logprobs.items()],
        lease_deadline_unix_ms=d.lease_deadline_unix_ms,
        block_checksums=list(d.block_checksums),
    )
    if d.first_token_logprob is not None:
        msg.first_token_logprob = d.first_token_logprob
    if d.progress_slot is not None:
        msg.progress_slot = d.progress_slot
    if d.state is not None:
        msg.state.CopyFrom(state_to_proto(d.state))
    return msg


def descriptor_from_proto(msg: handoff_pb2.HandoffDescriptor) -> HandoffDescriptor:
    """Raises ValueError for a malformed descriptor."""
    return HandoffDescriptor(
        request_id=msg.request_id,
        model_fingerprint=msg.model_fingerprint,
        layout=layout_from_proto(msg.layout),
        rank_block_ids={rb.rank: tuple(rb.block_ids) for rb in msg.rank_blocks},
        num_tokens=msg.num_tokens,
        transport_kind=msg.transport_kind,
        endpoints={
            e.rank: RankEndpoint(e.rank, e.address, _ENDPOINTS((e.address, e.rank), e.agent_metadata))
            for e in msg.rank_endpoints
        },
        first_token_id=msg.first_token_id,
        lease_deadline_unix_ms=msg.lease_deadline_unix_ms,
        block_checksums=tuple(msg.block_checksums),
        first_token_logprob=msg.first_token_logprob if msg.HasField("first_token_logprob") else None,
        first_token_top_logprobs={t.token_id: t.logprob for t in msg.first_token_top_logprobs},
        progress_slot=msg.progress_slot if msg.HasField("progress_slot") else None,
        state=state_from_proto(msg.state, {e.rank: e.address for e in msg.rank_endpoints})
        if msg.HasField("state") else None,
    )


def push_to_proto(p: PushRequest) -> prefill_worker_pb2.PushKVRequest:
    return prefill_worker_pb2.PushKVRequest(
        request_id=p.request_id,
        dst_layout=layout_to_proto(p.dst_layout),
        dst_block_ids=list(p.dst_block_ids),
        first_block=p.first_block,
        decode_worker_id=p.decode_worker_id,
        group_key=p.group_key or "",
        backend=p.backend,
        timeout_ms=max(1, round(p.timeout_s * 1000)),
        state=None if p.state is None else prefill_worker_pb2.StatePush(
            dst_layout=state_layout_to_proto(p.state.dst_layout), dst_slot=p.state.dst_slot),
    )


def push_from_proto(msg: prefill_worker_pb2.PushKVRequest) -> PushRequest:
    """Raises ValueError for a malformed request."""
    return PushRequest(
        request_id=msg.request_id,
        dst_layout=layout_from_proto(msg.dst_layout),
        dst_block_ids=tuple(msg.dst_block_ids),
        first_block=msg.first_block,
        decode_worker_id=msg.decode_worker_id,
        group_key=msg.group_key or None,
        backend=msg.backend,
        timeout_s=msg.timeout_ms / 1000,
        state=StatePush(state_layout_from_proto(msg.state.dst_layout), msg.state.dst_slot) if msg.HasField("state") else None,
    )


def grant_to_proto(g: PushGrant) -> prefill_worker_pb2.PushKVResponse:
    return prefill_worker_pb2.PushKVResponse(group_key=g.group_key, store_path=g.store_path, is_new_group=g.is_new_group)


def grant_from_proto(msg: prefill_worker_pb2.PushKVResponse) -> PushGrant:
    return PushGrant(group_key=msg.group_key, store_path=msg.store_path, is_new_group=msg.is_new_group)
