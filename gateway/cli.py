"""`splitserve gateway`: flags and the entry point (SPLITSERVE_<OPTION> / --config come from splitserve.cli)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from splitserve import grpc_security
from splitserve.client.options import TLSConfig
from splitserve.gateway.config import DEFAULT_MAX_BODY_BYTES, GatewayConfig
from splitserve.telemetry import init_process

DESCRIPTION = """\
Run the OpenAI-compatible HTTP gateway of a splitserve cluster. It tokenizes
prompts (and applies the model's chat template), sends token ids to a router
over gRPC, detokenizes the streamed tokens and answers in OpenAI's shapes:
POST /v1/completions, POST /v1/chat/completions (tools, reasoning), GET
/v1/models, plus GET /health, GET /metrics (Prometheus) and the OpenAPI
document at /openapi.json (browsable at /docs). It binds 127.0.0.1 unless
told otherwise. Every option can also come from a SPLITSERVE_<OPTION>
environment variable (SPLITSERVE_ROUTER, SPLITSERVE_API_KEY=key1,key2, ...) or
a --config YAML file."""

EPILOG = """\
example:
  splitserve gateway --router 127.0.0.1:50061 --model /models/Qwen2.5-0.5B-Instruct --port 8000
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"model": "Qwen2.5-0.5B-Instruct", "prompt": "def fib(n):", "max_tokens": 32}'"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--router", default="127.0.0.1:50061", metavar="HOST:PORT",
        help="router gRPC address (default %(default)s)")
    add("--model", default=None, metavar="DIR",
        help="the model directory the workers serve: its tokenizer, chat template and config.json "
        "(default: the embedded default model)")
    add("--served-model-name", default=None, metavar="NAME",
        help="the model's name in /v1/models and in requests "
        "(default: the directory's name, or 'splitserve-default' for the embedded model)")
    add("--host", default="127.0.0.1",
        help="HTTP bind address; 0.0.0.0 exposes the gateway to the network (default %(default)s)")
    add("--port", type=int, default=8000,
        help="HTTP port; 0 picks a free one (default %(default)s)")
    add("--api-key", action="append", default=None, metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1; repeat for several keys "
        "(default: no authentication)")
    add("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
        help="larger request bodies get 413 (default %(default)s)")
    add("--max-model-len", type=int, default=None, metavar="TOKENS",
        help="prompt + completion tokens per request "
        "(default: the model's max_position_embeddings)")
    add("--reasoning-parser", choices=["none", "think"], default="none",
        help="'think' returns <think>...</think> as reasoning_content (default %(default)s)")
    add("--tool-call-parser", choices=["none", "hermes"], default="hermes",
        help="'hermes' turns <tool_call>{json}</tool_call> into tool_calls when a request has tools "
        "(default %(default)s)")
    add("--request-timeout", type=float, default=600.0, metavar="SECONDS",
        help="deadline of one generation (default %(default)s)")
    add("--max-in-flight", type=int, default=1024, metavar="N",
        help="generation requests handled at once; more get 429 with Retry-After (default %(default)s)")
    add("--access-log", action="store_true", help="log every HTTP request")
    add("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level (default %(default)s)")  # fmt: skip


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    keys = [k.strip() for k in args.api_key or () if k.strip()]
    return GatewayConfig(
        router=args.router, model=Path(args.model) if args.model else None, served_model_name=args.served_model_name,
        host=args.host, port=args.port, api_keys=tuple(keys), max_body_bytes=args.max_body_bytes,
        max_model_len=None if args.max_model_len is None else int(args.max_model_len),
        reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
        request_timeout_s=args.request_timeout, max_in_flight=args.max_in_flight,
        router_tls=router_tls(grpc_security.current()),
        max_grpc_message_bytes=grpc_security.current().max_message_bytes,
    )  # fmt: skip


def router_tls(security: grpc_security.GrpcSecurity) -> TLSConfig | None:
    """The SDK's TLS settings from the process's --tls-* flags (the gateway is a client of the router)."""
    tls = security.tls
    if tls is None:
        return None
    present = tls.cert is not None
    return TLSConfig(root_certificates=tls.ca, private_key=tls.key if present else None,
                     certificate_chain=tls.cert if present else None)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Serves until SIGTERM / SIGINT; returns the exit code."""
    import uvicorn

    from splitserve.gateway.app import create_app

    init_process("splitserve-gateway", args.log_level)  # OTEL_* tracing, logs with trace ids
    try:
        config = config_from_args(args)
        app = create_app(config)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=args.log_level.lower(), access_log=args.access_log,
        timeout_graceful_shutdown=5, lifespan="on",
    ))  # fmt: skip
    server.run()
    return 0 if server.started else 1
