"""A scripted router and real gateways in front of it (see tests/fixtures/scripted_router.py)."""

import pytest

from splitserve.engine.default_model import default_model_path
from splitserve.engine.tokenizer import Tokenizer
from splitserve.gateway.config import GatewayConfig
from tests.fixtures.gateway_server import running_gateway
from tests.fixtures.scripted_router import ScriptedRouter

MODEL = "splitserve-default"


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(default_model_path())


@pytest.fixture(scope="module")
def router(tokenizer):
    router = ScriptedRouter(tokenizer)
    router.start()
    yield router
    router.stop()


@pytest.fixture(scope="module")
def gateway(router):
    with running_gateway(GatewayConfig(router=router.address, max_body_bytes=64 * 1024)) as url:
        yield url


@pytest.fixture(scope="module")
def openai_client(gateway):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=30) as client:
        yield client
