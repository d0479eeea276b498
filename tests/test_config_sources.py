"""Options from flags > SPLITSERVE_* environment > --config YAML > defaults, for every subcommand."""

import argparse

import pytest

from splitserve.config_sources import add_config_option, apply_config_sources


def _parser():
    p = argparse.ArgumentParser()
    p.add_argument("--block-size", type=int, default=16, help="x")
    p.add_argument("--transport", default="nixl", choices=["nixl", "inproc"], help="x")
    p.add_argument("--stop", action="append", default=[], help="x")
    p.add_argument("--json", action="store_true", help="x")
    add_config_option(p)
    return p


def _parse(argv, monkeypatch, env=None):
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    p = _parser()
    apply_config_sources(p, argv)
    return p.parse_args(argv)


def test_precedence(tmp_path, monkeypatch):
    cfg = tmp_path / "w.yaml"
    cfg.write_text("block-size: 32\ntransport: inproc\nstop: [a, b]\njson: true\n")
    args = _parse(["--config", str(cfg)], monkeypatch)
    assert (args.block_size, args.transport, args.stop, args.json) == (32, "inproc", ["a", "b"], True)
    args = _parse(["--config", str(cfg)], monkeypatch, {"SPLITSERVE_BLOCK_SIZE": "64", "SPLITSERVE_JSON": "false"})
    assert args.block_size == 64 and args.json is False
    args = _parse(["--config", str(cfg), "--block-size", "8"], monkeypatch, {"SPLITSERVE_BLOCK_SIZE": "64"})
    assert args.block_size == 8
    monkeypatch.delenv("SPLITSERVE_BLOCK_SIZE")
    assert _parse([], monkeypatch).block_size == 16


@pytest.mark.parametrize(
    "text, message",
    [
        ("blok-size: 3\n", "unknown option 'blok-size'"),
        ("block-size: many\n", "'many' is not a valid value for --block-size"),
        ("transport: carrier-pigeon\n", "is not one of \\['nixl', 'inproc'\\]"),
        ("- a\n- b\n", "must hold a mapping"),
        ("a: [\n", "is not valid YAML"),
    ],
)
def test_bad_config_files_name_the_problem(tmp_path, monkeypatch, text, message):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(ValueError, match=message):
        _parse(["--config", str(cfg)], monkeypatch)


def test_bad_environment_value(monkeypatch):
    with pytest.raises(ValueError, match="SPLITSERVE_JSON: expected true or false"):
        _parse([], monkeypatch, {"SPLITSERVE_JSON": "maybe"})
