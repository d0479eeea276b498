"""Proto <-> dataclass conversion of the handoff messages (engine/wire.py): what goes out comes
back equal, the recurrent state of a hybrid model's handoff included."""

import pytest

from splitserve.engine.handoff import HandoffDescriptor, RankEndpoint
from splitserve.engine.handoff_push import PushRequest, StatePush
from splitserve.engine.state_handoff import StateHandoff
from splitserve.engine.transfer.layout import KVLayout
from splitserve.engine.transfer.state_plan import StateLayout
from splitserve.engine.wire import descriptor_from_proto, descriptor_to_proto, push_from_proto, push_to_proto
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
