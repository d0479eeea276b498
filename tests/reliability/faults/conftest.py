"""The fault tests' fixtures: one `splitserve up` cluster per module (2 prefill + 2 decode workers,
the embedded model), and `recovered`, the check after every scenario: all workers back, every pool
intact and holding nothing, no process outside `up`'s tree."""

from __future__ import annotations

import shutil

import pytest

from tests.e2e.process_tree import alive, descendants
from tests.reliability.faults.fault_cluster import (
    LEASE_S,
    NUM_WORKERS,
    PROMPT,
    ROUTER_ARGS,
    SHARDS,
    FaultCluster,
    complete,
)

openai = pytest.importorskip("openai")
if shutil.which("etcd") is None:
    pytest.skip("needs the etcd binary (apt-get install etcd-server)", allow_module_level=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = FaultCluster.start(tmp_path_factory.mktemp("faults"), SHARDS, router_args=ROUTER_ARGS,
                        worker_args=[f"--handoff-lease-s={LEASE_S}"])  # fmt: skip
    try:
        c.wait_whole(NUM_WORKERS)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def oai(cluster):
    with openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def expected(oai):
    """The greedy answer to PROMPT with nothing going wrong."""
    return complete(oai, PROMPT).choices[0].text


@pytest.fixture(autouse=True)
def recovered(cluster):
    """After every scenario: all workers back, every pool intact and holding nothing, no orphan."""
    yield
    if cluster.proc.poll() is not None:  # a test stopped the cluster
        return
    cluster.set_faults("")
    cluster.wait_whole(NUM_WORKERS)
    cluster.wait_clean(timeout_s=LEASE_S + 5)
    family = descendants(cluster.proc.pid)
    orphans = [pid for pid in cluster.note_processes() | cluster.seen_pids if alive(pid) and pid not in family]
    assert not orphans, f"processes outside splitserve up's tree: {orphans}"
