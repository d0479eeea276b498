"""Slot choice and topology building: pure functions, exact state."""

import pytest

from splitserve.control_plane.assignment import (
    Assignment,
    AssignmentError,
    NoFreeSlotError,
    Peer,
    choose_slots,
    replica_peers,
)
from splitserve.control_plane.keys import ClusterKeys
from splitserve.control_plane.lifecycle import LifecycleState, LifecycleStatus
from splitserve.control_plane.records import LeaderRecord, WorkerRecord
from splitserve.control_plane.shard_spec import Role, parse_inference_shards
from splitserve.control_plane.topology import WorkerInfo, topology_from_kvs

SPEC = parse_inference_shards("tp=2,role=prefill+tp=1,dp=2,role=decode")
SLOTS = SPEC.slots()


def ids(slots):
    return [slot.slot_id for slot in slots]


def test_fills_in_slot_order_and_refills_the_first_hole():
    occupied: dict[int, str] = {}
    for worker in "abcd":
        (slot,) = choose_slots(SLOTS, occupied, role=None)
        occupied[slot.slot_id] = worker
    assert occupied == {0: "a", 1: "b", 2: "c", 3: "d"}
    del occupied[1]
    assert ids(choose_slots(SLOTS, occupied, role=None)) == [1]


def test_role_restricts_the_slots():
    assert ids(choose_slots(SLOTS, {}, role=Role.DECODE)) == [2]
    assert ids(choose_slots(SLOTS, {2: "x"}, role=Role.DECODE)) == [3]
    assert ids(choose_slots(SLOTS, {0: "x"}, role=Role.PREFILL)) == [1]


def test_multi_rank_workers_get_aligned_consecutive_ranks():
    spec = parse_inference_shards("role=prefill,tp=4+role=prefill,tp=2")
    slots = spec.slots()
    assert ids(choose_slots(slots, {}, role=None, num_gpu_ranks=2)) == [0, 1]
    # rank 1 taken: ranks 1-2 would straddle, so 2-3 it is
    assert ids(choose_slots(slots, {1: "x"}, role=None, num_gpu_ranks=2)) == [2, 3]
    assert ids(choose_slots(slots, {1: "x", 2: "y"}, role=None, num_gpu_ranks=2)) == [4, 5]
    assert ids(choose_slots(slots, {}, role=None, num_gpu_ranks=4)) == [0, 1, 2, 3]


def test_preferred_slots_are_taken_back_when_free():
    assert ids(choose_slots(SLOTS, {2: "x"}, role=Role.DECODE, preferred_slot_ids=[3])) == [3]
    assert ids(choose_slots(SLOTS, {}, role=Role.DECODE, preferred_slot_ids=[3])) == [3]
    # not free, or not the worker's role: ordinary first fit
    assert ids(choose_slots(SLOTS, {3: "x"}, role=Role.DECODE, preferred_slot_ids=[3])) == [2]
    assert ids(choose_slots(SLOTS, {}, role=Role.DECODE, preferred_slot_ids=[0])) == [2]


def test_no_free_slot_says_how_many_are_taken():
    with pytest.raises(NoFreeSlotError) as info:
        choose_slots(SLOTS, {2: "x", 3: "y"}, role=Role.DECODE)
    assert str(info.value) == "no decode replica has a free slot: 2 of 2 decode slots are taken"
    with pytest.raises(NoFreeSlotError) as info:
        choose_slots(SLOTS, {1: "x"}, role=None, num_gpu_ranks=2)
    assert str(info.value) == "no replica has 2 free consecutive ranks: 1 of 4 slots are taken"


def test_impossible_requests_are_assignment_errors():
    decode_only = parse_inference_shards("role=decode").slots()
    with pytest.raises(AssignmentError, match="^the spec has no prefill slots$"):
        choose_slots(decode_only, {}, role=Role.PREFILL)
    with pytest.raises(AssignmentError, match="^num_gpu_ranks=3 exceeds the 2 ranks of the largest prefill replica$"):
        choose_slots(SLOTS, {}, role=Role.PREFILL, num_gpu_ranks=3)
    with pytest.raises(AssignmentError, match="num_gpu_ranks must be a positive integer, got 0"):
        choose_slots(SLOTS, {}, role=None, num_gpu_ranks=0)


def test_replica_peers_list_every_rank_with_its_worker():
    peers = replica_peers(SLOTS, {1: "b"}, {"b": "127.0.0.1:2"}, (0, 0))
    assert peers == (Peer(0), Peer(1, "b", "127.0.0.1:2"))


def test_assignment_rejects_slots_of_two_replicas():
    with pytest.raises(ValueError, match="consecutive ranks of one replica"):
        Assignment("w", 1, (SLOTS[2], SLOTS[3]), (Peer(0),), 1)


def kv(key: bytes, value: bytes, lease: int = 0):
    return (key, value, lease)


def test_topology_from_kvs_exact_state():
    keys = ClusterKeys("c1")
    a = WorkerRecord("a", "127.0.0.1:1", Role.PREFILL, 2)
    c = WorkerRecord("c", "127.0.0.1:3")
    kvs = [
        kv(keys.spec, SPEC.to_text().encode()),
        kv(keys.leader, LeaderRecord("cp-1", "127.0.0.1:9").encode(), 7),
        kv(keys.lifecycle, LifecycleStatus(LifecycleState.PAUSED).encode()),
        kv(keys.worker("a"), a.encode(), 11),
        kv(keys.worker("c"), c.encode(), 33),
        kv(keys.slot(0), b"a", 11),
        kv(keys.slot(1), b"a", 11),
        kv(keys.slot(3), b"c", 33),
        kv(keys.slot(2), b"gone", 44),  # slot key without a worker key: free
        kv(keys.draining("c"), b"", 33),
    ]
    topology = topology_from_kvs(keys, SPEC, 42, kvs)
    assert topology.occupants == ("a", "a", None, "c")
    assert topology.workers == (WorkerInfo(a, 11, (0, 1), False), WorkerInfo(c, 33, (3,), True))
    assert topology.free_slot_ids() == (2,)
    assert topology.leader == LeaderRecord("cp-1", "127.0.0.1:9")
    assert topology.lifecycle.state is LifecycleState.PAUSED
    assignment = topology.assignment_for("a")
    assert assignment == Assignment("a", 11, (SLOTS[0], SLOTS[1]), (Peer(0, "a", "127.0.0.1:1"), Peer(1, "a", "127.0.0.1:1")), 42)
    assert (assignment.role, assignment.group_index, assignment.dp_replica, assignment.is_complete) == (
        Role.PREFILL, 0, 0, True,
    )  # fmt: skip
    assert topology.assignment_for("c").peers == (Peer(0, "c", "127.0.0.1:3"),)
    assert topology.assignment_for("nobody") is None
