"""Fixtures of the control-plane tests: a real etcd, one cluster namespace per test, async tests.

`async def test_*` functions run under asyncio.run (tests/conftest.py). One etcd serves the whole session; each test gets
its own cluster name (keys under /splitserve-test/<name>/), so tests never see
each other's keys. A test that restarts etcd uses `own_etcd` instead.
"""

from __future__ import annotations

import re
import uuid

import pytest

from splitserve.control_plane.keys import ClusterKeys
from tests.fixtures.etcd import EtcdServer


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory):
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def own_etcd(tmp_path):
    """An etcd only this test uses (it may stop and restart it)."""
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    yield server
    server.kill()


@pytest.fixture
def cluster_keys(request: pytest.FixtureRequest) -> ClusterKeys:
    name = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name).strip("-")[:40]
    return ClusterKeys(cluster=f"{name}-{uuid.uuid4().hex[:6]}", prefix="/splitserve-test")
