"""`--pack-for-tp auto`: packed memory only where the cluster's shard spec has decode groups of a
larger TP than a one-rank NIXL prefill worker's (engine/handoff_pack.py)."""

import argparse
from types import SimpleNamespace

import pytest

from splitserve.control_plane.shard_spec import parse_inference_shards
from splitserve.engine.handoff_pack import resolve_pack_for_tp
from splitserve.engine.worker_cli import add_worker_arguments
from splitserve.engine.worker_runtime import WorkerSpec
from splitserve.engine.worker_server import _resolve_pack_for_tp

PREFILL = dict(role="prefill", transport="nixl", world_size=1)


@pytest.mark.parametrize(
    ("value", "where", "decode_tps", "expected"),
    [
        ("auto", {}, [2], 2),
        ("auto", {}, [1, 4, 2], 4),  # several decode groups: the largest by default (each request names its own)
        ("auto", {}, [1], 0),  # no reshard with strided head slices
        ("auto", {}, None, 0),  # no control plane: nothing known
        ("auto", {"transport": "shm"}, [2], 0),  # only NIXL reads packed memory
        ("auto", {"world_size": 2}, [2], 0),  # one-rank prefill groups only
        ("auto", {"role": "decode"}, [2], 0),
        (0, {}, [2], 0),  # an explicit value wins
        (2, {}, None, 2),
    ],
)
def test_resolve(value, where, decode_tps, expected):
    assert resolve_pack_for_tp(value, **(PREFILL | where), decode_tps=decode_tps) == expected


def _spec(pack_for_tp, transport="nixl", role="prefill", engine="torch") -> WorkerSpec:
    return WorkerSpec(model="m", role=role, transport=transport, engine_options={"pack_for_tp": pack_for_tp},
                      engine=engine)


def test_the_worker_resolves_auto_from_the_topology_it_registered_with():
    topology = SimpleNamespace(spec=parse_inference_shards("role=prefill,tp=1,dp=2+role=decode,tp=2"))
    registration = SimpleNamespace(topology=topology)
    assert _resolve_pack_for_tp(_spec("auto"), registration).engine_options["pack_for_tp"] == 2
    assert _resolve_pack_for_tp(_spec("auto"), None).engine_options["pack_for_tp"] == 0
    assert _resolve_pack_for_tp(_spec("auto", "shm"), registration).engine_options["pack_for_tp"] == 0
    assert _resolve_pack_for_tp(_spec(3), registration).engine_options["pack_for_tp"] == 3
    assert _resolve_pack_for_tp(_spec("auto", engine="sim"), registration).engine_options["pack_for_tp"] == 0
    same = SimpleNamespace(topology=SimpleNamespace(spec=parse_inference_shards("role=prefill+role=decode,dp=2")))
    assert _resolve_pack_for_tp(_spec("auto"), same).engine_options["pack_for_tp"] == 0


def test_the_flag_takes_auto_or_a_size(capsys):
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    assert parser.parse_args([]).pack_for_tp == "auto"
    assert parser.parse_args(["--pack-for-tp", "AUTO"]).pack_for_tp == "auto"
    assert parser.parse_args(["--pack-for-tp", "2"]).pack_for_tp == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["--pack-for-tp", "-1"])
    assert "expected auto or a TP size >= 0" in capsys.readouterr().err


def test_an_auto_tp_the_model_cannot_hold_warns_and_an_explicit_one_is_refused(llama_ckpt, caplog):
    """The test model has 2 kv heads: tp=3 fits neither way (2 % 3, 3 % 2). Resolved from `auto`, the
    prefill worker still starts (arena kept for TP sizes the router names that fit, tp=2 packed, tp=3 not);
    named on the command line, it refuses to start with the reason."""
    from splitserve.engine.handoff_pack import HandoffPacker
    from splitserve.engine.worker_runtime import _pack_arena_bytes, build_engine

    spec = WorkerSpec(model=str(llama_ckpt), role="prefill", transport="nixl", engine_options={"pack_for_tp": 3})
    engine = build_engine(spec)
    with pytest.raises(ValueError, match="pack_for_tp=3 does not fit this model"):
        _pack_arena_bytes(spec, engine)
    auto = WorkerSpec(model=str(llama_ckpt), role="prefill", transport="nixl", engine_options={"pack_for_tp": 3},
                      pack_for_tp_auto=True)
    with caplog.at_level("WARNING"):
        assert _pack_arena_bytes(auto, engine) > 0
    assert "packing only for decode TP sizes that fit" in caplog.text
    named = {"a": 2, "b": 3}
    packer = HandoffPacker(engine, transport=None, default_tp=3, target_tp=lambda rid: named.get(rid, 0))
    assert packer.target("a").tp == 2
    assert packer.target("b") is None and packer.target("unnamed") is None  # tp=3: warned, not packed
