"""`splitserve` command line: one entry point, one subcommand per job.

    splitserve generate [--model DIR] [--prompt TEXT ...] [--json]   offline generation
    splitserve control-plane --etcd HOST:PORT --inference-shards SPEC  cluster control plane
    splitserve gateway --router HOST:PORT [--model DIR]              OpenAI-compatible HTTP API
    splitserve up [--model DIR] [--inference-shards SPEC]            a whole local cluster
    splitserve trace report FILE [--out PNG]                         TTFT breakdown from exported spans
    splitserve bench router [--trace FILE] [--workers N] [--policy P] routing policies on a trace, vs an oracle

Every subcommand also takes `--config FILE.yaml` and SPLITSERVE_<OPTION>
environment variables (see config_sources.py). Subcommands register themselves through `add_arguments(parser)` + `run(args)`
so that light processes (control plane, router, gateway) never import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from splitserve.config_sources import add_config_option, apply_config_sources
from splitserve.security_flags import add_security_arguments, configure_process

# name -> (module, one-line help). Modules are imported only when chosen.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("splitserve.engine.generate_cli", "generate text offline with one engine (TP/PP via --tp/--pp)"),
    "control-plane": ("splitserve.control_plane.cli", "run the gRPC control plane (etcd-backed shard assignment)"),
    "router": ("splitserve.router.cli", "run a router (prefix/load-aware routing, prefill -> decode orchestration)"),
    "prefill-worker": ("splitserve.prefill_worker.cli", "run a prefill worker (computes and hands off KV)"),
    "decode-worker": ("splitserve.decode_worker.cli", "run a decode worker (imports KV, streams tokens)"),
    "gateway": ("splitserve.gateway.cli", "run the OpenAI-compatible HTTP gateway in front of a router"),
    "up": ("splitserve.up", "start a whole local cluster (etcd, control plane, workers, router, gateway)"),
    "bench": ("splitserve.router.bench_cli", "benchmarks: `bench router` = replay a Mooncake trace through the routing policies"),
    "trace": ("splitserve.telemetry.cli", "trace tools: `trace report FILE` = TTFT breakdown table + PNG waterfall"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve",
        description="Disaggregated prefill/decode LLM serving. Every subcommand has its own --help.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in SUBCOMMANDS:
        args = parser.parse_args(argv)  # prints help / the error for unknown commands
        parser.print_help()
        return 2
    name = argv[0]
    module = importlib.import_module(SUBCOMMANDS[name][0])
    sub = argparse.ArgumentParser(
        prog=f"splitserve {name}",
        description=getattr(module, "DESCRIPTION", None) or module.__doc__.split("\n\n")[0],
        epilog=getattr(module, "EPILOG", None),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_arguments(sub)
    add_security_arguments(sub, name)
    add_config_option(sub)
    try:
        apply_config_sources(sub, argv[1:])
    except ValueError as exc:
        sub.error(str(exc))
    args = sub.parse_args(argv[1:])
    try:
        configure_process(args)  # TLS / message limits of every gRPC hop, etcd credentials
    except ValueError as exc:
        sub.error(str(exc))
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
