"""`splitserve control-plane`: flags, SPLITSERVE_* environment defaults, and the entry point.

Wire into the top-level CLI with `add_arguments(subparser)` and
`run(args)`; `main(argv)` is the standalone form (`python -m
splitserve.control_plane`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import aetcd

from splitserve.control_plane.errors import SpecMismatchError
from splitserve.control_plane.registry import DEFAULT_LEASE_TTL_S
from splitserve.control_plane.server import ControlPlaneConfig, serve
from splitserve.control_plane.shard_spec import ShardSpecError
from splitserve.telemetry import init_process
from splitserve.telemetry.metrics import add_metrics_arguments

DESCRIPTION = """\
Run one control-plane replica. It assigns every registering prefill/decode
worker a GPU-rank slot of the --inference-shards spec, keeps shard
assignments, topology and the cluster lifecycle in etcd, and serves the
splitserve.v1.ControlPlane gRPC API plus grpc.health.v1. Start several
replicas with the same flags for high availability: one is elected leader
(an etcd lease), the others serve reads and take over within --lease-ttl
seconds when it dies. Every flag can also be set through the environment
variable named in its help."""

EPILOG = """\
spec format:
  groups joined by '+', each a comma-separated list of key=value:
  role=prefill|decode (required), tp=N, pp=N, dp=N (positive, default 1).
  'tp=2,role=prefill+tp=1,dp=2,role=decode' needs 2 + 2 = 4 GPU ranks.

example:
  splitserve control-plane --etcd 127.0.0.1:2379 \\
      --inference-shards 'tp=2,role=prefill+tp=1,dp=2,role=decode' --listen 127.0.0.1:50051"""


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"SPLITSERVE_{name}", default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the control-plane flags to `parser` (a subcommand's parser or a standalone one)."""
    spec = _env("INFERENCE_SHARDS")
    parser.add_argument(
        "--inference-shards", default=spec, required=spec is None, metavar="SPEC",
        help="shard groups to fill, e.g. 'tp=2,role=prefill+tp=1,dp=2,role=decode' "
        "(env SPLITSERVE_INFERENCE_SHARDS)",
    )  # fmt: skip
    parser.add_argument(
        "--etcd", default=_env("ETCD", "127.0.0.1:2379"), metavar="HOST:PORT",
        help="etcd endpoint (env SPLITSERVE_ETCD; default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--listen", default=_env("LISTEN", "127.0.0.1:50051"), metavar="HOST:PORT",
        help="gRPC listen address; port 0 picks a free one (env SPLITSERVE_LISTEN; default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--advertise-address", default=_env("ADVERTISE_ADDRESS"), metavar="HOST:PORT",
        help="address workers and routers are told to use for this replica when it leads "
        "(env SPLITSERVE_ADVERTISE_ADDRESS; default: the bound listen address)",
    )  # fmt: skip
    parser.add_argument(
        "--cluster", default=_env("CLUSTER", "default"),
        help="cluster name; keys live under <key-prefix>/<cluster>/ so clusters can share an etcd "
        "(env SPLITSERVE_CLUSTER; default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--key-prefix", default=_env("KEY_PREFIX", "/splitserve"),
        help="etcd key prefix (env SPLITSERVE_KEY_PREFIX; default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--lease-ttl", type=int, default=int(_env("LEASE_TTL", str(DEFAULT_LEASE_TTL_S))), metavar="SECONDS",
        help="TTL of the leader lease: a dead leader is replaced within about this long "
        "(env SPLITSERVE_LEASE_TTL; default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--replica-id", default=_env("REPLICA_ID"),
        help="name of this replica (env SPLITSERVE_REPLICA_ID; default <hostname>-<pid>)",
    )  # fmt: skip
    parser.add_argument(
        "--grace-period", type=float, default=float(_env("GRACE_PERIOD", "5")), metavar="SECONDS",
        help="on SIGTERM, how long in-flight calls may finish (env SPLITSERVE_GRACE_PERIOD; default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--log-level", default=_env("LOG_LEVEL", "INFO"), choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level (env SPLITSERVE_LOG_LEVEL; default %(default)s)",
    )  # fmt: skip
    add_metrics_arguments(parser)


def config_from_args(args: argparse.Namespace) -> ControlPlaneConfig:
    return ControlPlaneConfig(
        inference_shards=args.inference_shards,
        etcd=args.etcd,
        listen=args.listen,
        advertise_address=args.advertise_address,
        cluster=args.cluster,
        key_prefix=args.key_prefix,
        lease_ttl_s=args.lease_ttl,
        replica_id=args.replica_id,
        grace_period_s=args.grace_period,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
    )


def run(args: argparse.Namespace) -> int:
    """Runs the replica until SIGTERM/SIGINT; returns the process exit code."""
    try:
        config = config_from_args(args)
    except ShardSpecError as e:
        print(f"error: --inference-shards: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    init_process("splitserve-control-plane", args.log_level)
    try:
        asyncio.run(serve(config))
    except SpecMismatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except aetcd.ClientError as e:
        print(f"error: etcd at {config.etcd}: {e}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve control-plane",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))
