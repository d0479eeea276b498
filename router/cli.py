"""`splitserve router`: flags, SPLITSERVE_ROUTER_* environment defaults, and the entry point.

Wire into the top-level CLI with `add_arguments(subparser)` and `run(args)`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from splitserve.router.cluster_view import BlockSizeMismatchError
from splitserve.router.config import RouterConfig
from splitserve.router.policy import POLICIES, PolicyConfig
from splitserve.router.server import serve
from splitserve.telemetry import init_process
from splitserve.telemetry.metrics import add_metrics_arguments

DESCRIPTION = """\
Run a router: the front door of a splitserve cluster. It follows the
cluster topology from the control plane, indexes which worker caches which
prompt prefix (from the workers' KV events over ZMQ, or approximately from
what it routed), picks a prefill and a decode worker per request (prefix
overlap against load, and the bytes the KV handoff would move), runs
Prefill -> handoff -> Decode with retries, and streams tokens back over the
splitserve.v1.Router gRPC API. Routers share no state: run several for
availability. Every flag can also be set through the environment variable
named in its help."""

EPILOG = """\
policies (--policy; names from the reference design's coordinator):
  load_balanced       least loaded prefill worker
  longest_prefix      the prefill worker caching the longest prefix of the prompt
  first_prefix_block  least loaded among the workers caching the prompt's first block
  scored              routing_alpha * cached fraction + (1 - routing_alpha) * free capacity

example:
  splitserve router --control-plane 127.0.0.1:50051 --listen 127.0.0.1:50061 \\
      --policy scored --routing-alpha 0.01 --disagg-min-uncached-tokens 64"""


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"SPLITSERVE_ROUTER_{name}", default)


def _bool_env(name: str, default: bool) -> bool:
    return (_env(name, "1" if default else "0") or "").lower() in ("1", "true", "yes", "on")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the router flags to `parser`."""
    add = parser.add_argument
    add("--control-plane", action="append", default=None, metavar="HOST:PORT",
        help="control-plane replica to follow the topology on; repeat for several "
        "(env SPLITSERVE_ROUTER_CONTROL_PLANE, comma-separated; default 127.0.0.1:50051)")
    add("--listen", default=_env("LISTEN", "127.0.0.1:50061"), metavar="HOST:PORT",
        help="gRPC listen address; port 0 picks a free one (env SPLITSERVE_ROUTER_LISTEN; default %(default)s)")
    add("--block-size", type=int, default=_env("BLOCK_SIZE"), metavar="TOKENS",
        help="KV block size in tokens; a worker advertising another is an error "
        "(env SPLITSERVE_ROUTER_BLOCK_SIZE; default: the workers' own)")
    add("--policy", choices=POLICIES, default=_env("POLICY", "scored"),
        help="prefill-worker policy (env SPLITSERVE_ROUTER_POLICY; default %(default)s)")
    add("--ttft-slo-s", type=float, default=float(_env("TTFT_SLO_S", "0")), metavar="SECONDS",
        help="admission: refuse (RESOURCE_EXHAUSTED; HTTP 429) requests whose predicted time to first token "
        "exceeds this (env SPLITSERVE_ROUTER_TTFT_SLO_S; default 0 = off)")
    add("--prefill-tokens-per-s", type=float, default=float(_env("PREFILL_TOKENS_PER_S", "20000")), metavar="N",
        help="admission model: prompt tokens one prefill worker computes per second (default %(default)s)")
    add("--routing-alpha", type=float, default=float(_env("ROUTING_ALPHA", "0.01")), metavar="A",
        help="scored policy: cache affinity (1) against load (0) (env SPLITSERVE_ROUTER_ROUTING_ALPHA; default %(default)s)")
    add("--transfer-weight", type=float, default=float(_env("TRANSFER_WEIGHT", "0.5")), metavar="W",
        help="decode choice: weight of handoff bytes against load, in [0, 1] "
        "(env SPLITSERVE_ROUTER_TRANSFER_WEIGHT; default %(default)s)")
    add("--disagg-min-uncached-tokens", type=int, default=int(_env("DISAGG_MIN_UNCACHED_TOKENS", "0")), metavar="N",
        help="let the decode worker prefill prompts with fewer uncached tokens than this "
        "(env SPLITSERVE_ROUTER_DISAGG_MIN_UNCACHED_TOKENS; default %(default)s = always disaggregate)")
    add("--enforce-disagg", action=argparse.BooleanOptionalAction, default=_bool_env("ENFORCE_DISAGG", False),
        help="fail requests rather than serve them aggregated when no prefill worker is available "
        "(env SPLITSERVE_ROUTER_ENFORCE_DISAGG)")
    add("--kv-bytes-per-block", type=int, default=_env("KV_BYTES_PER_BLOCK"), metavar="BYTES",
        help="bytes of one KV block, to report handoff sizes (env SPLITSERVE_ROUTER_KV_BYTES_PER_BLOCK)")
    add("--kv-events", action=argparse.BooleanOptionalAction, default=_bool_env("KV_EVENTS", True),
        help="follow the workers' KV events; --no-kv-events indexes what was routed instead "
        "(env SPLITSERVE_ROUTER_KV_EVENTS; default on)")
    add("--approximate-ttl", type=float, default=float(_env("APPROXIMATE_TTL", "120")), metavar="SECONDS",
        help="without events: how long a routed prompt counts as cached (env SPLITSERVE_ROUTER_APPROXIMATE_TTL; default %(default)s)")
    add("--max-in-flight", type=int, default=int(_env("MAX_IN_FLIGHT", "1024")), metavar="N",
        help="requests run at once; more get RESOURCE_EXHAUSTED (env SPLITSERVE_ROUTER_MAX_IN_FLIGHT; default %(default)s)")
    add("--max-running-per-worker", type=int, default=int(_env("MAX_RUNNING_PER_WORKER", "256")), metavar="N",
        help="requests one worker may have from this router (env SPLITSERVE_ROUTER_MAX_RUNNING_PER_WORKER; default %(default)s)")
    add("--topology-timeout", type=float, default=float(_env("TOPOLOGY_TIMEOUT", "30")), metavar="SECONDS",
        help="at start, how long to wait for the control plane's topology (env SPLITSERVE_ROUTER_TOPOLOGY_TIMEOUT; default %(default)s)")
    add("--prefill-timeout", type=float, default=float(_env("PREFILL_TIMEOUT", "60")), metavar="SECONDS",
        help="deadline of one Prefill call; past it the request is retried on another prefill worker "
        "(env SPLITSERVE_ROUTER_PREFILL_TIMEOUT; default %(default)s)")
    add("--decode-first-chunk-timeout", type=float, default=float(_env("DECODE_FIRST_CHUNK_TIMEOUT", "60")),
        metavar="SECONDS", help="a Decode stream without output by then is retried on another decode worker "
        "(env SPLITSERVE_ROUTER_DECODE_FIRST_CHUNK_TIMEOUT; default %(default)s)")
    add("--decode-stall-timeout", type=float, default=float(_env("DECODE_STALL_TIMEOUT", "60")), metavar="SECONDS",
        help="a Decode stream silent this long after its first tokens fails UNAVAILABLE "
        "(env SPLITSERVE_ROUTER_DECODE_STALL_TIMEOUT; default %(default)s)")
    add("--suspect-cooldown", type=float, default=float(_env("SUSPECT_COOLDOWN", "10")), metavar="SECONDS",
        help="skip a worker this long after a call to it failed UNAVAILABLE or DEADLINE_EXCEEDED "
        "(env SPLITSERVE_ROUTER_SUSPECT_COOLDOWN; default %(default)s; 0 = never)")
    add("--grace-period", type=float, default=float(_env("GRACE_PERIOD", "5")), metavar="SECONDS",
        help="on SIGTERM, how long running requests may go on (env SPLITSERVE_ROUTER_GRACE_PERIOD; default %(default)s)")
    add("--log-level", default=_env("LOG_LEVEL", "INFO"), choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level (env SPLITSERVE_ROUTER_LOG_LEVEL; default %(default)s)")  # fmt: skip
    add_metrics_arguments(parser)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    control_planes = args.control_plane or (_env("CONTROL_PLANE", "127.0.0.1:50051") or "").split(",")
    policy = PolicyConfig(
        policy=args.policy, routing_alpha=args.routing_alpha, transfer_weight=args.transfer_weight,
        disagg_min_uncached_tokens=args.disagg_min_uncached_tokens, enforce_disagg=args.enforce_disagg,
        kv_bytes_per_block=None if args.kv_bytes_per_block is None else int(args.kv_bytes_per_block),
    )  # fmt: skip
    return RouterConfig(
        control_planes=tuple(a.strip() for a in control_planes if a.strip()), listen=args.listen,
        block_size=None if args.block_size is None else int(args.block_size), policy=policy,
        kv_events=args.kv_events, approximate_ttl_s=args.approximate_ttl, max_in_flight=args.max_in_flight,
        ttft_slo_s=args.ttft_slo_s, prefill_tokens_per_s=args.prefill_tokens_per_s,
        max_running_per_worker=args.max_running_per_worker, topology_timeout_s=args.topology_timeout,
        grace_period_s=args.grace_period, metrics_port=args.metrics_port, metrics_host=args.metrics_host,
        prefill_timeout_s=args.prefill_timeout, decode_first_chunk_timeout_s=args.decode_first_chunk_timeout,
        decode_stall_timeout_s=args.decode_stall_timeout, suspect_cooldown_s=args.suspect_cooldown,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Runs the router until SIGTERM/SIGINT; returns the process exit code."""
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    init_process("splitserve-router", args.log_level)
    try:
        asyncio.run(serve(config))
    except (BlockSizeMismatchError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve router", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))
