"""Fixtures of the router tests: async tests, a real etcd for the topology tests.

`async def test_*` functions run under asyncio.run (tests/conftest.py).
"""

from __future__ import annotations

import re
import uuid

import pytest

from splitserve.control_plane.keys import ClusterKeys
from tests.fixtures.etcd import EtcdServer


@pytest.fixture(scope="module")
def router_etcd(tmp_path_factory: pytest.TempPathFactory):
    server = EtcdServer(tmp_path_factory.mktemp("router-etcd"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def router_keys(request: pytest.FixtureRequest) -> ClusterKeys:
    name = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name).strip("-")[:40]
    return ClusterKeys(cluster=f"{name}-{uuid.uuid4().hex[:6]}", prefix="/splitserve-test")
