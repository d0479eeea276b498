import pytest

from splitserve.control_plane.shard_spec import (
    Role,
    ShardGroup,
    ShardSpec,
    ShardSpecError,
    Slot,
    parse_inference_shards,
)


def test_parses_the_documented_example():
    spec = parse_inference_shards("tp=2,role=prefill+tp=1,dp=2,role=decode")
    assert spec == ShardSpec(
        (ShardGroup(0, Role.PREFILL, tp=2, pp=1, dp=1), ShardGroup(1, Role.DECODE, tp=1, pp=1, dp=2))
    )
    assert spec.num_ranks == 4
    assert spec.to_text() == "role=prefill,tp=2,pp=1,dp=1+role=decode,tp=1,pp=1,dp=2"
    assert parse_inference_shards(spec.to_text()) == spec


def test_defaults_whitespace_and_key_order():
    assert parse_inference_shards(" role = decode ") == ShardSpec((ShardGroup(0, Role.DECODE, 1, 1, 1),))
    assert parse_inference_shards("dp=3,pp=2,role=prefill,tp=4").groups[0] == ShardGroup(0, Role.PREFILL, 4, 2, 3)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty --inference-shards spec"),
        ("  ", "empty --inference-shards spec"),
        ("role=prefill+", "empty group 2"),
        ("tpp=2,role=prefill", "unknown key 'tpp' in group 1"),
        ("role=prefill+tp=1,tp=2,role=decode", "duplicate key 'tp' in group 2"),
        ("role=prefill,role=decode", "duplicate key 'role' in group 1"),
        ("tp=2,role=prefill+tp=1", "missing role in group 2"),
        ("tp=0,role=prefill", "tp must be a positive integer, got '0' in group 1"),
        ("role=decode,pp=-1", "pp must be a positive integer, got '-1' in group 1"),
        ("role=decode,dp=two", "dp must be a positive integer, got 'two' in group 1"),
        ("role=decode,dp=", "dp must be a positive integer, got '' in group 1"),
        ("role=decode,tp=1.5", "tp must be a positive integer, got '1.5' in group 1"),
        ("role=prefil", "role must be prefill or decode, got 'prefil' in group 1"),
        ("role=prefill,tp2", "expected key=value, got 'tp2' in group 1"),
        ("role=prefill,,tp=2", "expected key=value, got '' in group 1"),
    ],
)
def test_errors_name_the_offending_token(text, message):
    with pytest.raises(ShardSpecError) as info:
        parse_inference_shards(text)
    assert str(info.value) == message


def test_dataclasses_validate_and_quote_bad_values():
    with pytest.raises(ValueError, match="tp must be a positive integer, got 0"):
        ShardGroup(0, Role.PREFILL, tp=0)
    with pytest.raises(ValueError, match="role must be a Role, got 'prefill'"):
        ShardGroup(0, "prefill")
    with pytest.raises(ValueError, match=r"rank \(tp_rank=2, pp_rank=0\) outside tp=2, pp=1"):
        Slot(0, 0, Role.DECODE, 0, tp_rank=2, pp_rank=0, tp=2, pp=1)


def test_slots_expand_group_then_replica_then_pp_then_tp():
    spec = parse_inference_shards("tp=2,role=prefill+tp=1,dp=2,role=decode")
    assert spec.slots() == (
        Slot(0, 0, Role.PREFILL, dp_replica=0, tp_rank=0, pp_rank=0, tp=2, pp=1),
        Slot(1, 0, Role.PREFILL, dp_replica=0, tp_rank=1, pp_rank=0, tp=2, pp=1),
        Slot(2, 1, Role.DECODE, dp_replica=0, tp_rank=0, pp_rank=0, tp=1, pp=1),
        Slot(3, 1, Role.DECODE, dp_replica=1, tp_rank=0, pp_rank=0, tp=1, pp=1),
    )
    assert [(s.rank, s.world_size) for s in spec.slots()] == [(0, 2), (1, 2), (0, 1), (0, 1)]


def test_slots_of_a_tp_pp_dp_group():
    slots = parse_inference_shards("role=decode,tp=2,pp=2,dp=2").slots()
    assert [(s.slot_id, s.dp_replica, s.pp_rank, s.tp_rank, s.rank) for s in slots] == [
        (0, 0, 0, 0, 0), (1, 0, 0, 1, 1), (2, 0, 1, 0, 2), (3, 0, 1, 1, 3),
        (4, 1, 0, 0, 0), (5, 1, 0, 1, 1), (6, 1, 1, 0, 2), (7, 1, 1, 1, 3),
    ]  # fmt: skip
    assert {s.world_size for s in slots} == {4}


def test_a_spec_without_a_decode_group_is_said_to_serve_nothing():
    assert parse_inference_shards("tp=1,role=decode").unservable_reason() is None  # decode prefills itself
    assert parse_inference_shards("tp=2,role=prefill+tp=1,role=decode,dp=2").unservable_reason() is None
    reason = parse_inference_shards("tp=2,role=prefill,dp=2").unservable_reason()
    assert "'role=prefill,tp=2,pp=1,dp=2' has no decode group" in reason
