"""Faults a `splitserve up` cluster must shrug off, default stage (~45 s): a prefill worker
SIGKILLed mid-prefill, clients that go away, the router, the control plane and etcd killed,
and `up` leaving no process behind. README "Reliability guarantees" states each guarantee;
tests/reliability/faults/test_worker_faults.py (slow stage) has the rest.

After every scenario (conftest.py) every worker's pool passes CheckIntegrity and holds
nothing, and no process is orphaned. engine/fault_injection.py holds a request in a named
phase so that a kill lands there.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import openai
import pytest

from tests.reliability.faults.fault_cluster import LEASE_S, MODEL, NUM_WORKERS, PROMPT, complete, kill


def in_background(fn, *args):
    pool = ThreadPoolExecutor(1)
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)
    return future


def test_prefill_worker_killed_during_prefill(cluster, oai, expected):
    cluster.set_faults("prefill=2000")
    since = cluster.fault_lines()
    answer = in_background(complete, oai, PROMPT)
    pid, _ = cluster.wait_fault_holder("prefill", since)
    kill(pid)
    # Held after its first token went out (PrefillStream): the decode worker goes on from prompt + first token.
    assert answer.result(timeout=60).choices[0].text == expected
    cluster.wait_log("prefill-worker-g0-dp", "exited with code -9; restarting it")


@pytest.mark.parametrize("phase", ["prefill", "stream"])
def test_client_disconnect_frees_every_block_within_1_s(cluster, phase):
    cluster.set_faults("prefill=2000" if phase == "prefill" else "stream=200")
    since = cluster.fault_lines()
    parts = urlsplit(cluster.url)
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True}).encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        cluster.wait_fault_holder(phase, since)
        assert any(r.num_in_use_blocks for r in cluster.reports().values())  # work is held now
    gone = time.monotonic()
    cluster.wait_clean(timeout_s=1.0)  # no request, pin or used block on any worker
    assert time.monotonic() - gone < 1.0


def test_killed_router_is_restarted_its_stream_resumed_and_an_orphaned_pin_expires(cluster, oai, expected):
    workers = cluster.worker_pids()
    router = cluster.child_pid("router")
    want = complete(oai, PROMPT, max_tokens=200).choices[0].text
    cluster.set_faults("transfer=3000")  # the handoff is pinned; the decode worker has not pulled it yet
    since = cluster.fault_lines()
    stream = iter(oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, temperature=0, stream=True))
    text = next(stream).choices[0].text
    cluster.wait_fault_holder("transfer", since)
    kill(router)
    killed = time.monotonic()
    cluster.set_faults("")
    # The gateway's SDK resumes the stream through the restarted router from the tokens sent
    # (client/resume.py): the client reads one unbroken answer.
    text += "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text == want
    # Nobody is left to ack or abort the first attempt's pin (the router died, the decode worker's
    # call was cancelled; the resumed request has an id of its own): the prefill worker frees it
    # when the lease runs out.
    cluster.wait_clean(timeout_s=max(0.5, LEASE_S + 2 - (time.monotonic() - killed)))
    assert time.monotonic() - killed < LEASE_S + 2
    assert_served_through(oai, expected, timeout_s=30)
    assert cluster.child_pid("router") != router
    assert cluster.worker_pids() == workers  # no worker restarted


def test_killed_control_plane_is_restarted_and_requests_go_on(cluster, oai, expected):
    workers = cluster.worker_pids()
    control_plane = cluster.child_pid("control-plane")
    kill(control_plane)
    for _ in range(3):  # the router keeps its view of the workers meanwhile
        assert complete(oai, PROMPT).choices[0].text == expected
    cluster.wait_whole(NUM_WORKERS)
    assert cluster.child_pid("control-plane") != control_plane
    assert cluster.worker_pids() == workers
    assert complete(oai, PROMPT).choices[0].text == expected


def test_etcd_stopped_then_killed_loses_no_request(cluster, oai, expected):
    workers = cluster.worker_pids()
    etcd = cluster.child_pid("etcd")
    kill(etcd, signal.SIGSTOP)  # etcd hangs: every request accepted meanwhile is served
    try:
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            assert complete(oai, PROMPT).choices[0].text == expected
    finally:
        kill(etcd, signal.SIGCONT)
    kill(etcd)  # etcd dies: `up` restarts it on its data directory, same ports
    for _ in range(3):
        assert complete(oai, PROMPT).choices[0].text == expected
    cluster.wait_whole(NUM_WORKERS)
    assert cluster.child_pid("etcd") != etcd
    assert cluster.worker_pids() == workers  # nothing restarted the workers
    assert complete(oai, PROMPT).choices[0].text == expected


def assert_served_through(oai, expected: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            assert complete(oai, PROMPT).choices[0].text == expected
            return
        except openai.APIStatusError as e:
            assert e.status_code == 503 and "Traceback" not in str(e), e
            assert time.monotonic() < deadline, f"still failing after {timeout_s} s: {e}"
            time.sleep(0.3)


def test_zz_stopping_up_leaves_no_process(cluster):
    """Last: every process `up` ever ran (restarted ones included) is gone after SIGTERM."""
    left = cluster.stop()
    assert cluster.proc.returncode == 0, cluster.log_text()[-3000:]
    assert not left, f"orphans: {left}"
