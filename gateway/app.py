"""The gateway's HTTP application (FastAPI): routes, authentication, errors, metrics.

    app = create_app(GatewayConfig(router="127.0.0.1:50061"))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{id}],
GET /health (200 only while the router reports SERVING), GET /metrics
(Prometheus), GET /openapi.json and /docs. Every error is OpenAI-shaped
(errors.py); request bodies are parsed by hand (http_body.py) so that bad
JSON, wrong types and oversized bodies get precise 4xx answers.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from splitserve.client import AsyncClient, ClientOptions, SplitserveError
from splitserve.gateway.chat import ChatRun
from splitserve.gateway.choice_output import TokenTexts
from splitserve.gateway.completions import CompletionRun
from splitserve.gateway.config import GatewayConfig
from splitserve.gateway.context import ServingContext
from splitserve.gateway.errors import APIError, from_sdk_error, status_phrase
from splitserve.gateway.http_body import parse_json_object, read_body, validate
from splitserve.gateway.metrics import GatewayMetrics
from splitserve.gateway.model_info import ModelInfo, load_model_info
from splitserve.gateway.requests import ChatCompletionRequest, CompletionRequest
from splitserve.gateway.responses import SSE_DONE, sse
from splitserve.gateway.streaming import ClientGone, EventStreamResponse, cancel_on_disconnect
from splitserve.telemetry.http import TraceMiddleware, time_to_first_message_s

log = logging.getLogger(__name__)

ROUTER_RECONNECT_WAIT_S = 10.0
"""A request that finds the router unreachable waits this long for it to come back (a restart by
`up` or Kubernetes takes seconds) before its 503: new requests then queue through the restart."""
STATUS_CLIENT_CLOSED = 499
"""Logged (never sent) when the client left before its answer."""


def _compile_chat_template(model: ModelInfo) -> None:
    """Compile the chat template now rather than in the first chat request's TTFT. One that does
    not compile is logged here; each chat request then answers 400 with jinja's message."""
    if not getattr(model.tokenizer, "chat_template", None):
        return
    try:
        model.tokenizer.compiled_chat_template()
    except Exception as e:  # noqa: BLE001 - a model's template may fail in any of jinja's ways
        log.warning("the chat template of %s does not compile (%s: %s); /v1/chat/completions will answer 400",
                    model.name, type(e).__name__, e)  # fmt: skip


def create_app(config: GatewayConfig, model: ModelInfo | None = None) -> FastAPI:
    """The ASGI app; `model` defaults to what config.model names (its tokenizer is loaded now)."""
    model = model or load_model_info(config.model, config.served_model_name, config.max_model_len)
    _compile_chat_template(model)
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        options = ClientOptions(timeout_s=config.request_timeout_s, max_attempts=2, tls=config.router_tls,
                                reconnect_wait_s=ROUTER_RECONNECT_WAIT_S,
                                max_message_bytes=config.max_grpc_message_bytes)  # fmt: skip
        client = AsyncClient(config.router, options=options)
        app.state.ctx = ServingContext(config, model, client, TokenTexts(model.tokenizer), metrics)
        async with anyio.create_task_group():  # loads anyio's asyncio backend (5-10 ms) now, not in the first stream's TTFT
            pass
        try:
            yield
        finally:
            await client.close()

    app = FastAPI(
        title="splitserve gateway", version="0.1.0", lifespan=lifespan,
        description=f"OpenAI-compatible API of a splitserve cluster serving `{model.name}`.",
    )  # fmt: skip
    _add_error_handlers(app)
    app.add_middleware(TraceMiddleware)  # request span, traceparent in/out, X-Splitserve-Timing

    def ctx_of(request: Request) -> ServingContext:
        return request.app.state.ctx

    def authorize(request: Request) -> None:
        if not config.api_keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        if not any(hmac.compare_digest(key.strip().encode(), k.encode()) for k in config.api_keys):
            raise APIError(401, "invalid API key", code="invalid_api_key")

    def model_card() -> dict:
        return {"id": model.name, "object": "model", "created": model.created, "owned_by": "splitserve",
                "root": str(model.path), "max_model_len": model.max_model_len}  # fmt: skip

    @app.get("/health", summary="200 while the router is serving, 503 otherwise")
    async def health(request: Request):
        if await ctx_of(request).client.health():
            return {"status": "ok", "model": model.name}
        return JSONResponse({"status": "unavailable", "reason": f"router {config.router} is not serving"}, 503)

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics_endpoint():
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/models", summary="The served model")
    async def list_models(request: Request):
        try:
            authorize(request)
        except APIError as e:
            return e.response()
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", summary="One model")
    async def get_model(model_id: str, request: Request):
        try:
            authorize(request)
            if model_id != model.name:
                raise _unknown_model(model_id, model.name)
        except APIError as e:
            return e.response()
        return model_card()

    @app.post(
        "/v1/completions", summary="Text completion (OpenAI)",
        openapi_extra=_body_schema(CompletionRequest),
    )  # fmt: skip
    async def completions(request: Request):
        return await _generate(request, ctx_of(request), CompletionRequest, CompletionRun, authorize)

    @app.post(
        "/v1/chat/completions", summary="Chat completion (OpenAI), with tools and reasoning",
        openapi_extra=_body_schema(ChatCompletionRequest),
    )  # fmt: skip
    async def chat_completions(request: Request):
        return await _generate(request, ctx_of(request), ChatCompletionRequest, ChatRun, authorize)

    return app


async def _generate(request: Request, ctx: ServingContext, request_type, run_type, authorize) -> Response:
    started = time.monotonic()
    endpoint, status = run_type.endpoint, 200
    metrics = ctx.metrics
    if ctx.num_in_flight >= ctx.config.max_in_flight:  # before reading the body: bounded memory
        metrics.requests.labels(endpoint, "429").inc()
        return APIError(429, f"the gateway is at capacity ({ctx.num_in_flight} requests in flight); retry later",
                        code="overloaded").response()  # fmt: skip
    ctx.num_in_flight += 1
    metrics.running.inc()
    is_streaming = False
    try:
        authorize(request)
        body = validate(request_type, parse_json_object(await read_body(request, ctx.config.max_body_bytes)))
        if body.model is not None and body.model != ctx.model.name:
            raise _unknown_model(body.model, ctx.model.name)
        run = run_type(body, ctx)
        if body.stream:
            response = await _stream(request, run, started)
            is_streaming = True
            return response
        result = await cancel_on_disconnect(request, run.response())
        ttft_s = time_to_first_message_s()  # the first token, not the whole answer (its last token)
        metrics.ttft_seconds.labels(endpoint).observe(time.monotonic() - started if ttft_s is None else ttft_s)
        metrics.record_usage(result["usage"])
        return JSONResponse(result, headers={"X-Request-Id": run.id})
    except APIError as e:
        status = e.status
        return e.response()
    except SplitserveError as e:
        error = from_sdk_error(e)
        status = error.status
        return error.response()
    except ClientGone:
        status = STATUS_CLIENT_CLOSED
        metrics.disconnects.inc()
        return Response(status_code=STATUS_CLIENT_CLOSED)
    finally:
        if not is_streaming:  # a stream counts itself when it ends
            ctx.num_in_flight -= 1
            metrics.running.dec()
            metrics.requests.labels(endpoint, str(status)).inc()
            metrics.request_seconds.labels(endpoint).observe(time.monotonic() - started)


async def _stream(request: Request, run, started: float) -> Response:
    """Waits for the first chunk (so failures before any output are real HTTP errors), then streams."""
    metrics, endpoint = run.ctx.metrics, run.endpoint
    events = run.events()
    try:
        first = await cancel_on_disconnect(request, anext(events, None))
    except BaseException:
        await events.aclose()
        raise
    metrics.ttft_seconds.labels(endpoint).observe(time.monotonic() - started)
    is_released = False

    def release() -> None:  # once: from the stream's end, or the response's if the stream never started
        nonlocal is_released
        if not is_released:
            is_released = True
            run.ctx.num_in_flight -= 1
            metrics.running.dec()

    async def body():
        status = "200"
        try:
            if first is not None:
                yield sse(first)
            async for payload in events:
                yield sse(payload)
            metrics.record_usage(run.usage())
            yield SSE_DONE
        except SplitserveError as e:
            status = "stream_error"
            yield sse(from_sdk_error(e).body())
            yield SSE_DONE
        except (asyncio.CancelledError, GeneratorExit):
            status = str(STATUS_CLIENT_CLOSED)
            metrics.disconnects.inc()
            raise
        finally:
            await events.aclose()
            release()
            metrics.requests.labels(endpoint, status).inc()
            metrics.request_seconds.labels(endpoint).observe(time.monotonic() - started)

    return EventStreamResponse(body(), headers={"X-Request-Id": run.id}, on_close=release)


def _unknown_model(name: str, served: str) -> APIError:
    return APIError(
        404, f"The model `{name}` does not exist. This server serves `{served}` (GET /v1/models).",
        param="model", code="model_not_found",
    )  # fmt: skip


def _body_schema(model) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        if error.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see /docs for the API"
        elif error.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(error.detail or status_phrase(error.status_code))
        response = APIError(error.status_code, message).response()
        if error.headers:
            response.headers.update(error.headers)
        return response

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        return APIError(400, f"invalid request: {error.errors()[:3]}").response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(error).__name__}: {error}").response()
