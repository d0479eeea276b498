"""Worker faults on a `splitserve up` cluster, slow stage (~100 s): prefill and decode workers
SIGKILLed at chosen phases, workers hung with SIGSTOP, and a prefill worker drained under load.
README "Reliability guarantees" states each guarantee; after every scenario (conftest.py) every
worker's pool passes CheckIntegrity and holds nothing, and no process is orphaned.
"""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from splitserve.client import Client, FinishReason, SamplingParams
from tests.reliability.faults.fault_cluster import (
    DECODE,
    MODEL,
    NUM_WORKERS,
    PREFILL,
    PROMPT,
    complete,
    kill,
    wait_dead,
)

pytestmark = pytest.mark.slow


def in_background(fn, *args):
    pool = ThreadPoolExecutor(1)
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)
    return future


# ---------------------------------------------------------------------- SIGKILL
def test_prefill_worker_killed_during_transfer(cluster, oai, expected):
    cluster.set_faults("transfer=2000")
    since = cluster.fault_lines()
    answer = in_background(complete, oai, PROMPT)
    cluster.wait_fault_holder("transfer", since)  # the decode worker is about to pull
    [holder] = [r.pid for r in cluster.reports(PREFILL).values() if r.num_handoffs]
    kill(holder)
    assert answer.result(timeout=60).choices[0].text == expected  # recomputed on the decode worker


def test_decode_worker_killed_before_its_pull_is_retried_from_the_pinned_copy(cluster, oai, expected):
    cluster.set_faults("transfer=2000")
    since = cluster.fault_lines()
    answer = in_background(complete, oai, PROMPT)
    pid, _ = cluster.wait_fault_holder("transfer", since)
    kill(pid)
    assert answer.result(timeout=60).choices[0].text == expected
    # the other decode worker pulled the pinned copy and released it (conftest.recovered: no pin left)


def test_decode_worker_killed_mid_stream_greedy_stream_resumes_elsewhere(cluster, oai):
    want = complete(oai, PROMPT, max_tokens=40).choices[0].text
    router_log = cluster.work / "logs" / "router.log"
    retries = router_log.read_text().count("retrying decode elsewhere")
    cluster.set_faults("stream=300")
    since = cluster.fault_lines()
    stream = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stream=True)
    chunks = iter(stream)
    text = "".join(next(chunks).choices[0].text for _ in range(3))  # the prefill's token, then the decode worker's
    pid, _ = cluster.wait_fault_holder("stream", since)
    kill(pid)
    text += "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == want  # recomputed from what was sent on the other decode worker: the same greedy tokens
    assert router_log.read_text().count("retrying decode elsewhere") == retries + 1  # it did break


def test_decode_worker_killed_mid_sampled_stream_resumes_with_the_same_draws(cluster, oai):
    want = complete(oai, PROMPT, max_tokens=40, temperature=0.8, seed=1).choices[0].text
    router_log = cluster.work / "logs" / "router.log"
    retries = router_log.read_text().count("retrying decode elsewhere")
    cluster.set_faults("stream=300")
    since = cluster.fault_lines()
    stream = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0.8, seed=1, stream=True)
    chunks = iter(stream)
    text = "".join(next(chunks).choices[0].text for _ in range(3))
    pid, _ = cluster.wait_fault_holder("stream", since)
    kill(pid)
    text += "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == want  # the next worker counted the sampling positions on past the sent tokens: same seeds
    assert router_log.read_text().count("retrying decode elsewhere") == retries + 1  # it did break


def late_stop_word(text: str) -> tuple[str, int]:
    """A 3-character stop word whose first occurrence lies in the second half of `text`, and where."""
    for start in range(len(text) * 2 // 3, len(text) - 3):
        word = text[start : start + 3]
        if word.strip() and text.index(word) >= len(text) // 2:
            return word, text.index(word)
    raise AssertionError(f"no late stop word in {text!r}")


def test_decode_worker_killed_mid_stream_with_stop_words_resumes_and_stops_at_them(cluster, oai):
    """The next worker matches the stop words on (engine/stop.py keeps the sent text's tail), so
    the stream stops where the unbroken one would, through the gateway and through the SDK."""
    free = complete(oai, PROMPT, max_tokens=40, temperature=0.8, seed=1).choices[0].text
    word, at = late_stop_word(free)
    params = SamplingParams(num_tokens_to_generate=40, temperature=0.8, seed=1, stop_words=(word,))
    with Client(cluster.router, tokenizer="default") as sdk:
        [unbroken] = sdk.generate([PROMPT], params, timeout_s=60)
    router_log = cluster.work / "logs" / "router.log"
    retries = router_log.read_text().count("retrying decode elsewhere")
    cluster.set_faults("stream=300")
    since = cluster.fault_lines()
    stream = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0.8, seed=1,
                                    stop=[word], stream=True)
    chunks = iter(stream)
    text = "".join(next(chunks).choices[0].text for _ in range(3))
    pid, _ = cluster.wait_fault_holder("stream", since)
    kill(pid)
    rest = [chunk for chunk in chunks if chunk.choices]
    text += "".join(chunk.choices[0].text for chunk in rest)
    assert text == free[:at] and rest[-1].choices[0].finish_reason == "stop"
    assert router_log.read_text().count("retrying decode elsewhere") == retries + 1  # it did break
    cluster.wait_whole(NUM_WORKERS)
    since = cluster.fault_lines()  # the same through the gRPC SDK, where only the workers match stop words
    with Client(cluster.router, tokenizer="default") as sdk:
        stream = sdk.stream(PROMPT, params, timeout_s=60)
        for _ in range(3):
            next(stream)
        pid, _ = cluster.wait_fault_holder("stream", since)
        kill(pid)
        *_, last = stream
    assert last.result.generated_tokens == unbroken.generated_tokens  # stopped on the same token
    assert last.result.finish_reason == unbroken.finish_reason == FinishReason.STOP


# ------------------------------------------------------------------ SIGSTOP (a hang)
def test_hung_prefill_worker_hits_the_deadline_and_leaves_routing(cluster):
    victim_id, victim = next(iter(cluster.reports(PREFILL).items()))
    kill(victim.pid, signal.SIGSTOP)
    try:
        params = SamplingParams(num_tokens_to_generate=8, temperature=0)
        with Client(cluster.router, tokenizer="default") as sdk:
            hit = first_routed_to_the_hung_worker(sdk, "x", lambda r: r.routing.num_prefill_attempts)
            assert 4 <= hit.ttft < 15  # the 4 s Prefill deadline fired, then the retry elsewhere
            later = sdk.generate([f"# later y{i}\n{PROMPT}" for i in range(3)], params, timeout_s=60)
            assert all(r.routing.num_prefill_attempts == 1 and r.routing.prefill_worker_id != victim_id for r in later)
        deadline = time.monotonic() + 30  # its etcd lease runs out: out of the topology
        while victim_id in {w.worker_id for w in cluster.workers()}:
            assert time.monotonic() < deadline, "the hung worker stayed in the topology"
            time.sleep(0.3)
    finally:
        kill(victim.pid, signal.SIGCONT)
    pids = cluster.wait_whole(NUM_WORKERS)
    assert victim.pid in pids.values()  # it came back on its own, not restarted


def test_hung_decode_worker_hits_the_first_chunk_deadline(cluster):
    victim_id, victim = next(iter(cluster.reports(DECODE).items()))
    kill(victim.pid, signal.SIGSTOP)
    try:
        params = SamplingParams(num_tokens_to_generate=8, temperature=0)
        with Client(cluster.router, tokenizer="default") as sdk:
            hit = first_routed_to_the_hung_worker(sdk, "z", lambda r: r.routing.num_decode_attempts)
            assert hit.generated_tokens and hit.routing.decode_worker_id != victim_id
            later = sdk.generate([f"# later w{i}\n{PROMPT}" for i in range(3)], params, timeout_s=60)
            assert all(r.routing.num_decode_attempts == 1 for r in later)  # it is skipped now
    finally:
        kill(victim.pid, signal.SIGCONT)


def first_routed_to_the_hung_worker(sdk, prefix: str, num_attempts):
    """Sends distinct prompts one by one until one needed a second attempt (its first worker
    was the hung one; idle workers tie, and the tie-break is a hash of the prompt); that result."""
    params = SamplingParams(num_tokens_to_generate=8, temperature=0)
    for i in range(12):
        # Over one KV block, so the first block's hash (the policy's tie-break) differs per prompt.
        [result] = sdk.generate([f"# request {prefix}{i}\n{PROMPT}"], params, timeout_s=60)
        if num_attempts(result) == 2:
            return result
        assert num_attempts(result) == 1
    raise AssertionError("no request was routed to the hung worker")


def test_decode_worker_hung_mid_stream_hits_the_stall_deadline_and_resumes_elsewhere(cluster):
    params = SamplingParams(num_tokens_to_generate=40, temperature=0.8, seed=1)
    with Client(cluster.router, tokenizer="default") as sdk:
        [unbroken] = sdk.generate([PROMPT], params, timeout_s=60)
    cluster.set_faults("stream=200")
    since = cluster.fault_lines()
    with Client(cluster.router, tokenizer="default") as sdk:
        stream = sdk.stream(PROMPT, params, timeout_s=60)
        for _ in range(3):
            next(stream)
        pid, _ = cluster.wait_fault_holder("stream", since)
        kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            *_, last = stream
            waited = time.monotonic() - started
        finally:
            kill(pid, signal.SIGCONT)
    assert 4 <= waited < 15  # the 5 s stall deadline fired, then the next worker went on
    assert last.result.generated_tokens == unbroken.generated_tokens  # the same seeded draws
    routing = last.result.routing
    assert routing.num_decode_attempts == 2 and "resumed after" in routing.reason, routing


# ------------------------------------------------------------------------ drain
def test_draining_a_prefill_worker_under_load_fails_no_request(cluster, oai):
    victim = next(iter(cluster.reports(PREFILL).values()))
    failures: list[BaseException] = []
    served = [0]
    stop = threading.Event()

    def client_loop(i: int) -> None:
        while not stop.is_set():
            try:
                out = complete(oai, f"{PROMPT}# {i} {served[0]}\n", max_tokens=8)
                assert out.choices[0].finish_reason in ("stop", "length")
                served[0] += 1
            except BaseException as e:  # noqa: BLE001 - every failure is a test failure
                failures.append(e)

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        kill(victim.pid, signal.SIGTERM)
        wait_dead(victim.pid, timeout_s=30)  # it drained and exited (`up` then starts it again)
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not failures, failures[:3]
    assert served[0] >= 6
    cluster.wait_log("exited with code 0; restarting it")
