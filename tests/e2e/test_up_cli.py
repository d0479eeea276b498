"""`splitserve up` as a command: its help explains every option, bad input and a missing etcd fail fast with
a message that says what to do, Ctrl-C (SIGINT) stops a simulated-engine cluster with dp=2 cleanly, and the
light front doors never import torch."""

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.e2e.process_tree import alive, descendants
from tests.gateway.http_helpers import post


def _run(*args, timeout=60, env=None):
    return subprocess.run([sys.executable, "-m", "splitserve", "up", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)  # fmt: skip


def test_help_explains_every_option():
    from splitserve.up import add_arguments

    out = _run("--help")
    assert out.returncode == 0 and "usage: splitserve up" in out.stdout
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and action.help.strip(), f"{action.option_strings} has no help"
            assert action.option_strings[0] in out.stdout
    for words in ("etcd", "Ctrl-C", "--inference-shards", "tp=1,role=prefill+tp=1,role=decode", "examples:"):
        assert words in out.stdout


def test_gateway_help_runs():
    out = subprocess.run([sys.executable, "-m", "splitserve", "gateway", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for option in ("--router", "--model", "--served-model-name", "--api-key", "--max-body-bytes", "--reasoning-parser"):
        assert option in out.stdout


def test_port_in_use_is_refused_before_starting_anything(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = _run("--port", str(port), "--work-dir", str(tmp_path), timeout=30)
    assert out.returncode == 1 and f"port {port} on 127.0.0.1 is in use" in out.stdout
    assert "etcd " not in out.stdout  # nothing was started


def test_missing_etcd_fails_fast_and_says_how_to_install_it(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))  # no etcd on PATH
    started = time.monotonic()
    out = _run("--port", "0", "--work-dir", str(tmp_path / "w"), env=env)
    assert out.returncode == 1 and time.monotonic() - started < 30
    assert "etcd not found on PATH" in out.stdout and "apt-get install etcd-server" in out.stdout
    assert "--etcd HOST:PORT" in out.stdout


def test_an_unreachable_external_etcd_fails_in_seconds_and_says_so(tmp_path):
    """`--etcd HOST:PORT` names an etcd up does not start: when nothing answers there, up says so
    after EXTERNAL_ETCD_WAIT_S (15 s) instead of waiting out --startup-timeout (180 s) silently."""
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    started = time.monotonic()
    out = _run("--port", "0", "--etcd", f"127.0.0.1:{port}", "--work-dir", str(tmp_path / "w"), timeout=60)
    assert out.returncode == 1 and time.monotonic() - started < 40
    assert f"etcd at 127.0.0.1:{port} did not answer its /health check within 15 s" in out.stdout, out.stdout


@pytest.mark.parametrize(
    "args, words",
    [
        (["--inference-shards", "tp=2,role=prefil"], "role must be prefill or decode, got 'prefil'"),
        (["--inference-shards", "tp=2,rol=decode"], "unknown key 'rol'"),
        (["--model", "/nonexistent/model"], "is not a directory"),
        (["--port", "70000"], "port must be in"),
        (["--transport", "inproc"], "invalid choice: 'inproc'"),  # each worker is a process of its own
        (["--inference-shards", "tp=1,role=prefill"], "has no decode group"),  # would answer no request
        (["--transport", "cuda_ipc", "--device", "cpu"], "cuda_ipc maps GPU memory"),
        (["--transport", "shm", "--device", "cuda"], "shm maps CPU pools"),
        (["--transport", "cuda_ipc"], "(--device auto is cpu here)"),  # the suite's auto device: cpu (conftest)
    ],
)
def test_bad_options_are_refused_before_starting_anything(args, words):
    out = _run(*args, timeout=30)
    assert out.returncode == 2 and words in out.stderr, out.stderr


def test_light_front_doors_do_not_import_torch():
    code = ("import sys, splitserve.up, splitserve.local_cluster, splitserve.gateway.app, splitserve.gateway.cli, "
            "splitserve.client; assert 'torch' not in sys.modules, 'torch imported'")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ctrl_c_stops_a_simulated_cluster_with_two_decode_replicas(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "splitserve", "up", "--engine", "sim", "--port", "0", "--work-dir", str(tmp_path),
         "--inference-shards", "tp=1,role=prefill+tp=1,dp=2,role=decode", "--api-key", "sesame"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )  # fmt: skip
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    output, url = [], None
    try:
        deadline = time.monotonic() + 90
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            output.append(line)
            url = line.split()[1] if line.startswith("READY ") else None
        assert url, "".join(output)
        assert sum("worker (group" in line for line in output) == 3
        assert post(url, "/v1/completions", {"prompt": "hello"})[0] == 401
        status, body, _ = post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 4},
                               {"Authorization": "Bearer sesame"})  # fmt: skip
        assert status == 200 and body["usage"]["completion_tokens"] == 4
        family = descendants(proc.pid)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        time.sleep(0.2)
        rest = "".join(output) + "".join(lines.queue)
        assert "no process left running" in rest, rest
        assert not [pid for pid in family if alive(pid)]
        assert (Path(tmp_path) / "logs" / "router.log").is_file()  # a given --work-dir is kept
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
