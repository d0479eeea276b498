"""Proto <-> dataclass conversion of the handoff messages (engine/wire.py): what goes out comes
back equal, the recurrent state of a hybrid model's handoff included."""

from dataclasses import replace

import pytest

from splitserve.engine.handoff import HandoffDescriptor, RankEndpoint
from splitserve.engine.handoff_push import PushRequest, StatePush
from splitserve.engine.state_handoff import StateHandoff
from splitserve.engine.transfer.layout import KVLayout
from splitserve.engine.transfer.state_plan import StateLayout
from splitserve.engine.wire import (
    EndpointInterner,
    descriptor_from_proto,
    descriptor_to_proto,
    push_from_proto,
    push_to_proto,
)
from splitserve.proto.v1 import handoff_pb2

KV = KVLayout(dtype="float32", block_size=8, tp=2, pp=1, num_layers=2, num_kv_heads=2, head_dim=16,
              layer_ranges=((0, 2),))
STATE = StateLayout(tp=2, pp=1, num_layers=2, layer_ranges=((0, 2),), num_heads=8, head_dim=8, num_groups=2,
                    state_size=16, conv_width=3, conv_dtype="float32", ssm_dtype="bfloat16")


def _descriptor(state=None) -> HandoffDescriptor:
    return HandoffDescriptor(
        request_id="r1", model_fingerprint="f" * 32, layout=KV, rank_block_ids={0: (4, 5), 1: (4, 5)},
        num_tokens=12, transport_kind="nixl",
        endpoints={r: RankEndpoint(r, "127.0.0.1", b"agent%d" % r) for r in range(2)},
        first_token_id=7, lease_deadline_unix_ms=123, block_checksums=(1, 2**64 - 1), first_token_logprob=-0.5,
        first_token_top_logprobs={7: -0.5, 9: -1.25}, state=state,
    )


def test_descriptor_with_state_round_trips():
    state = StateHandoff(STATE, slot=3, checksum=(2**31 - 2) << 32 | 5, endpoints={0: b"\x00ep0", 1: b"ep1"})
    desc = _descriptor(state)
    msg = descriptor_to_proto(desc)
    wire = handoff_pb2.HandoffDescriptor.FromString(msg.SerializeToString())
    assert wire.HasField("state") and wire.state.slot == 3 and [e.rank for e in wire.state.endpoints] == [0, 1]
    assert descriptor_from_proto(wire) == desc


def test_descriptor_without_state_has_no_state_field():
    msg = descriptor_to_proto(_descriptor())
    assert not msg.HasField("state")
    assert descriptor_from_proto(msg).state is None


def test_bad_state_is_a_value_error_naming_it():
    msg = descriptor_to_proto(_descriptor(StateHandoff(STATE, slot=0, checksum=1)))
    msg.state.layout.num_heads = 7  # not divisible by tp=2
    with pytest.raises(ValueError, match="heads 7"):
        descriptor_from_proto(msg)
    msg = descriptor_to_proto(_descriptor(StateHandoff(STATE, slot=0, checksum=1)))
    msg.state.layout.tp = 0
    with pytest.raises(ValueError, match="'tp': 0"):
        descriptor_from_proto(msg)
    msg = descriptor_to_proto(_descriptor(StateHandoff(STATE, slot=0, checksum=1)))
    msg.state.slot = -1
    with pytest.raises(ValueError, match="slot"):
        descriptor_from_proto(msg)


@pytest.mark.parametrize("state", [None, StatePush(STATE, dst_slot=2)])
def test_push_request_round_trips(state):
    push = PushRequest(request_id="r1", dst_layout=KV, dst_block_ids=() if state else (1, 2), first_block=0,
                       decode_worker_id="d", group_key=None, backend="gloo", timeout_s=2.5, state=state)
    assert push_from_proto(push_to_proto(push)) == push


def test_equal_endpoint_metadata_comes_back_as_one_object():
    """Request after request from one prefill worker: the same bytes object, so the transports'
    metadata lookups hit cached hashes; changed metadata (a re-exposed pool) or another worker's
    is never swapped for an old object."""
    state = StateHandoff(STATE, slot=3, checksum=5, endpoints={0: b"s0" * 5000, 1: b"s1"})
    desc = replace(_descriptor(state), endpoints={r: RankEndpoint(r, "10.0.0.1:5", b"m%d" % r * 7000) for r in range(2)})

    def parsed(d):
        return descriptor_from_proto(handoff_pb2.HandoffDescriptor.FromString(descriptor_to_proto(d).SerializeToString()))

    first, second = parsed(desc), parsed(desc)
    assert first == second == desc
    for r in range(2):
        assert second.endpoints[r].agent_metadata is first.endpoints[r].agent_metadata
        assert second.state.endpoints[r] is first.state.endpoints[r]
    moved = replace(desc, endpoints={**desc.endpoints, 0: RankEndpoint(0, "10.0.0.1:5", b"n0" * 7000)})
    assert parsed(moved).endpoints[0].agent_metadata == b"n0" * 7000
    other = replace(desc, endpoints={r: RankEndpoint(r, "10.0.0.2:5", b"m%d" % r * 7000) for r in range(2)})
    got = parsed(other)
    assert got.endpoints[1].agent_metadata == desc.endpoints[1].agent_metadata
    assert got.endpoints[1].agent_metadata is not first.endpoints[1].agent_metadata  # keyed by address too
    assert parsed(desc).endpoints[0].agent_metadata == desc.endpoints[0].agent_metadata  # back to the first


def test_endpoint_interner_forgets_past_its_limit():
    interner = EndpointInterner(limit=2)
    a = interner(("x", 0), bytes(bytearray(b"abc")))
    assert interner(("x", 0), bytes(bytearray(b"abc"))) is a
    interner(("y", 0), b"1")
    interner(("z", 0), b"2")  # the third key starts the table over
    assert interner(("x", 0), bytes(bytearray(b"abc"))) is not a
