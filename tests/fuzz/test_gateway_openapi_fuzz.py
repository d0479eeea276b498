"""Property-based fuzzing of the gateway against its own OpenAPI document (schemathesis).

Every operation of /openapi.json gets generated requests, valid and invalid (wrong types,
missing fields, out-of-range values, odd strings), with and without the API key; the real
gateway app under uvicorn answers them from a scripted router. The properties: no 5xx, an
OpenAI-shaped error body on every 4xx of /v1, and an answer within the call timeout (no hang).
The default stage runs a few examples per operation; `-m slow` runs many more.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from splitserve.engine.default_model import default_model_path
from splitserve.engine.tokenizer import Tokenizer
from splitserve.gateway.config import GatewayConfig
from tests.fixtures.gateway_server import running_gateway
from tests.fixtures.scripted_router import ScriptedRouter

API_KEY = "fuzz-key"
CALL_TIMEOUT_S = 20.0
FAST_EXAMPLES, SLOW_EXAMPLES = 8, 300


@pytest.fixture(scope="module")
def gateway_url():
    router = ScriptedRouter(Tokenizer(default_model_path()))
    router.start()
    config = GatewayConfig(router=router.address, api_keys=(API_KEY,), max_body_bytes=64 * 1024, request_timeout_s=15)
    try:
        with running_gateway(config) as url:
            yield url
    finally:
        router.stop()


@pytest.fixture(scope="module")
def operations(gateway_url):
    schema = schemathesis.openapi.from_url(f"{gateway_url}/openapi.json")
    found = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in found} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"}
    return found


def _check(case, gateway_url: str, with_key: bool) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"} if with_key else {}
    response = case.call(base_url=gateway_url, headers=headers, timeout=CALL_TIMEOUT_S)  # a hang raises
    case.validate_response(response, checks=[not_a_server_error])
    if case.path.startswith("/v1") and 400 <= response.status_code < 500:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"], error
    if case.path.startswith("/v1") and not with_key:
        assert response.status_code in (401, 404, 405), response.status_code


def _fuzz(operations, gateway_url: str, max_examples: int, with_key: bool = True) -> None:
    """schemathesis' pytest plugin does not run under this pytest: drive its strategies with hypothesis."""
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=max_examples, deadline=None, suppress_health_check=list(HealthCheck),
                      derandomize=True, database=None)  # fmt: skip
            def run(case):
                _check(case, gateway_url, with_key)

            try:
                run()
            except Unsatisfiable:  # no invalid input exists (an operation without parameters or body)
                assert mode is GenerationMode.NEGATIVE, operation.label


def test_gateway_fuzz(operations, gateway_url):
    _fuzz(operations, gateway_url, FAST_EXAMPLES)


def test_gateway_fuzz_without_api_key(operations, gateway_url):
    _fuzz(operations, gateway_url, 5, with_key=False)


@pytest.mark.slow
def test_gateway_fuzz_long(operations, gateway_url):
    _fuzz(operations, gateway_url, SLOW_EXAMPLES)
