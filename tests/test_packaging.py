"""The package layout: one `splitserve` namespace, import rules, CLI help."""

import json
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_folder_is_installed():
    setup = _pyproject()["tool"]["setuptools"]
    listed = set(setup["packages"])
    dirs = setup["package-dir"]
    for name, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            dotted = name + ("" if rel == Path(".") else "." + ".".join(rel.parts))
            assert dotted in listed, f"{dotted} ({init.parent}) is missing from [tool.setuptools] packages"


def test_torch_pin_admits_only_the_local_cpu_build():
    deps = _pyproject()["project"]["dependencies"]
    torch_req = next(d for d in deps if d.startswith("torch"))
    assert "<=2.13.0" in torch_req, torch_req


@pytest.mark.slow
def test_wheel_puts_nothing_generic_at_the_top(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
    )
    [wheel] = tmp_path.glob("splitserve-*.whl")
    tops = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"splitserve", "splitserve-0.1.0.dist-info"}, tops


def test_import_rules_hold():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_imports.py")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_light_package_import_does_not_load_torch():
    code = "import sys, splitserve, splitserve.router, splitserve.control_plane; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("command", [[], ["generate"], ["control-plane"]])
def test_cli_help_runs(command):
    out = subprocess.run([sys.executable, "-m", "splitserve", *command, "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "usage: splitserve" in out.stdout


def test_every_cli_option_has_help():
    import argparse
    import importlib

    from splitserve.cli import SUBCOMMANDS

    for name, (module, _) in SUBCOMMANDS.items():
        parser = argparse.ArgumentParser()
        importlib.import_module(module).add_arguments(parser)
        undocumented = [a.dest for a in parser._actions if not a.help]
        assert not undocumented, f"splitserve {name}: options without help: {undocumented}"


@pytest.mark.parametrize(
    "args, words",
    [
        (["--model", "{tmp}/none"], "does not exist"),
        # A bad layout fails in the rank processes: said as the rank's error, not its traceback.
        (["--tp", "3", "--device", "cpu"], ": 4 attention heads cannot be split over tp=3"),
        (["--device", "cuda"], "CUDA is not available here"),  # on this CPU-only machine
        (["--json-schema", "@{tmp}/none.json"], "--json-schema @"),
        (["--json-schema", '{"type": "nonsense"}'], "json_schema cannot be compiled"),
        (["--grammar", "start: (("], "grammar cannot be compiled"),
    ],
)
def test_cli_reports_bad_input_without_a_traceback(tmp_path, args, words):
    import torch

    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    out = subprocess.run([sys.executable, "-m", "splitserve", "generate", "--prompt", "hi", *args],
                         capture_output=True, text=True, timeout=180)  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert words in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_generate_follows_a_json_schema_from_a_file(tmp_path):
    """`splitserve generate --json-schema @FILE`: the text is JSON that the schema accepts."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
              "maximum": 9}}, "required": ["ok", "n"], "additionalProperties": False}  # fmt: skip
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    out = subprocess.run([sys.executable, "-m", "splitserve", "generate", "--prompt", "JSON:", "--prompt", "x",
                          "--json-schema", f"@{tmp_path}/schema.json", "--max-tokens", "40", "--json"],
                         capture_output=True, text=True, timeout=180)  # fmt: skip
    assert out.returncode == 0, out.stderr
    results = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(results) == 2
    for result in results:
        value = json.loads(result["generated_text"])
        assert result["status"] == "stopped" and set(value) == {"ok", "n"} and isinstance(value["ok"], bool)


def test_a_worker_without_etcd_says_so_in_one_line():
    """No etcd at --etcd: exit 1 (a retry may pass) with the endpoint named, not aetcd's traceback."""
    import socket

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    out = subprocess.run([sys.executable, "-m", "splitserve", "decode-worker", "--engine", "sim", "--etcd",
                          f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert f"error: etcd at 127.0.0.1:{port}:" in out.stderr and "Traceback" not in out.stderr, out.stderr
