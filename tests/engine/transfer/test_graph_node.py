"""Rewriting a captured kernel's scalar arguments (engine/transfer/graph_node.py): how the
rewritable slots are found, and the switch that turns it off. The GPU half (graphs captured,
rewritten and launched) is in test_graph_copy_gpu.py."""

from __future__ import annotations

import struct

import pytest

from splitserve.engine.transfer import graph_node


def _i32(v: int) -> bytes:
    return struct.pack("=i", v)


def test_each_sentinel_is_found_in_its_one_four_byte_slot():
    params = [b"\0" * 8, _i32(7), _i32(123456789), _i32(42), struct.pack("=q", 987654321), _i32(987654321)]
    assert graph_node.find_slots(params, (987654321, 123456789)) == [5, 2]


def test_a_sentinel_inside_a_wider_argument_is_not_a_slot():
    """An 8-byte argument whose low half equals the sentinel is a pointer or int64, never rewritten."""
    params = [struct.pack("=q", 0x2F3A5C17), _i32(1)]
    with pytest.raises(graph_node.Unsupported, match="found in 0"):
        graph_node.find_slots(params, (0x2F3A5C17,))


def test_a_sentinel_in_two_slots_cannot_be_told_apart():
    params = [_i32(555), _i32(9), _i32(555)]
    with pytest.raises(graph_node.Unsupported, match="found in 2"):
        graph_node.find_slots(params, (555,))


def test_the_switch_turns_the_driver_path_off(monkeypatch):
    monkeypatch.setattr(graph_node, "_DRIVER", [])
    monkeypatch.setenv("SPLITSERVE_GRAPH_PARAMS", "0")
    assert graph_node.driver() is None
    with pytest.raises(graph_node.Unsupported, match="driver library"):
        graph_node.ScalarGraph(lambda *a: None, (1, 2, 3), (1, 1, 1), 4)
