"""Fixtures of the router tests: async tests, a real etcd for the topology tests.

`async def test_*` functions run under asyncio.run with a 30 s cap (no
pytest-asyncio needed), like the control-plane tests.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import uuid

import pytest

from splitserve.control_plane.keys import ClusterKeys
from tests.fixtures.etcd import EtcdServer

ASYNC_TEST_TIMEOUT_S = 30


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    asyncio.run(asyncio.wait_for(pyfuncitem.obj(**kwargs), ASYNC_TEST_TIMEOUT_S))
    return True


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
