"""`splitserve up`: a whole cluster on this machine with one command.

Wire into the top-level CLI with `add_arguments(parser)` and `run(args)`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from splitserve.control_plane.shard_spec import ShardSpecError
from splitserve.local_cluster import (
    DEFAULT_INFERENCE_SHARDS,
    UP_TRANSPORTS,
    LocalCluster,
    StartupError,
    UpConfig,
)
from splitserve.security_flags import child_environment
from splitserve.supervisor import supervise

DESCRIPTION = """\
Start a whole splitserve cluster on this machine, on loopback: a real etcd
(the `etcd` binary on PATH, a temporary data directory and free ports), the
control plane with --inference-shards, one prefill or decode worker process per
dp replica of the spec, the router and the OpenAI-compatible gateway, all as
child processes. With no options it serves the embedded default model, offline.
It prints the gateway URL and a READY line when every part answers, restarts
any child that exits (same command and ports; see --max-restarts), and stops
everything (workers drain first) on Ctrl-C or SIGTERM, leaving no process
behind. Logs of every process go to --work-dir/logs."""

EPILOG = """\
examples:
  splitserve up                                         # embedded model, 1 prefill + 1 decode worker
  splitserve up --model ./Qwen2.5-0.5B-Instruct --port 8080
  splitserve up --inference-shards 'tp=2,role=prefill+tp=1,dp=2,role=decode' --device cuda
  splitserve up --engine sim                            # simulated workers: no model weights, no GPU

then:
  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"model": "splitserve-default", "prompt": "def fib(n):", "max_tokens": 32}'"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model and shards")
    model.add_argument("--model", type=Path, default=None, metavar="DIR",
                       help="Hugging Face model directory (safetensors + tokenizer.json); default: the embedded tiny model")
    model.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="the model's name in the OpenAI API (default: the directory's name, or "
                       "'splitserve-default' for the embedded model)")
    model.add_argument("--inference-shards", default=DEFAULT_INFERENCE_SHARDS, metavar="SPEC",
                       help="shard groups joined by '+', each 'role=prefill|decode' with optional tp=, pp=, dp= "
                       "(default %(default)s); one worker process runs per dp replica")
    model.add_argument("--engine", choices=["torch", "sim"], default="torch",
                       help="torch runs the model; sim runs simulated workers (modelled timing, pseudo-tokens)")
    model.add_argument("--device", default="auto", help="worker device: auto (CUDA if present), cpu or cuda")
    model.add_argument("--transport", choices=UP_TRANSPORTS, default="auto",
                       help="KV handoff transport between workers; auto = NIXL when installed, else torch_dist; "
                       "shm: CPU pools through shared memory; cuda_ipc: GPU pools mapped over CUDA IPC")
    model.add_argument("--block-size", type=int, default=16, metavar="TOKENS", help="KV block size (default %(default)s)")
    net = parser.add_argument_group("addresses")
    net.add_argument("--host", default="127.0.0.1",
                     help="gateway bind address (default %(default)s; 0.0.0.0 exposes it to the network)")
    net.add_argument("--port", type=int, default=8000, help="gateway port; 0 picks a free one (default %(default)s)")
    net.add_argument("--router-port", type=int, default=0, help="router gRPC port on 127.0.0.1 (default: a free one)")
    net.add_argument("--control-plane-port", type=int, default=0,
                     help="control-plane gRPC port on 127.0.0.1 (default: a free one)")
    net.add_argument("--etcd", default=None, metavar="HOST:PORT",
                     help="use this running etcd instead of starting one")
    net.add_argument("--etcd-binary", default=None, metavar="PATH", help="the etcd executable (default: etcd on PATH)")
    net.add_argument("--api-key", action="append", default=None, metavar="KEY",
                     help="require 'Authorization: Bearer KEY' at the gateway; repeat for several keys")
    more = parser.add_argument_group("process control")
    more.add_argument("--work-dir", type=Path, default=None, metavar="DIR",
                      help="logs and etcd data (default: a temporary directory, removed on a clean stop)")
    more.add_argument("--max-restarts", type=int, default=5, metavar="N",
                      help="restart a child process (router, gateway, control plane, etcd, worker) that exits, "
                      "on the same ports, at most N times a minute each; past that, or with 0, stop the whole "
                      "cluster (default %(default)s)")
    more.add_argument("--startup-timeout", type=float, default=180.0, metavar="SECONDS",
                      help="give up if the cluster is not ready by then (default %(default)s)")
    more.add_argument("--show-logs", action="store_true", help="also print every process's output, prefixed")
    more.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                      help="extra argument for every worker, e.g. --worker-arg=--num-blocks=512 (repeatable)")
    more.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                      help="extra argument for the router, e.g. --router-arg=--policy=load_balanced (repeatable)")
    more.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                      help="extra argument for the gateway, e.g. --gateway-arg=--reasoning-parser=think (repeatable)")


def config_from_args(args: argparse.Namespace) -> UpConfig:
    return UpConfig(
        model=args.model, served_model_name=args.served_model_name, inference_shards=args.inference_shards,
        engine=args.engine, etcd=args.etcd, etcd_binary=args.etcd_binary, host=args.host, port=args.port,
        router_port=args.router_port, control_plane_port=args.control_plane_port, api_keys=tuple(args.api_key or ()),
        transport=args.transport, block_size=args.block_size, device=args.device, worker_args=tuple(args.worker_arg),
        router_args=tuple(args.router_arg), gateway_args=tuple(args.gateway_arg), work_dir=args.work_dir,
        startup_timeout_s=args.startup_timeout, child_env=_security_env(args), max_restarts=args.max_restarts,
    )  # fmt: skip


def _security_env(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """The --tls-* / --etcd-* options, for every child (security_flags.py)."""
    env = child_environment(args)
    if not args.etcd and any(k.startswith("SPLITSERVE_ETCD_") for k in env):
        raise ValueError("--etcd-user/--etcd-password/--etcd-ca/--etcd-cert/--etcd-key need --etcd HOST:PORT "
                         "of a running etcd with those settings (the etcd `up` starts has no auth or TLS)")
    return tuple(sorted(env.items()))


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except (ValueError, ShardSpecError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return asyncio.run(_main(config, show_logs=args.show_logs, drop_env=_own_environment_names()))


def _own_environment_names() -> frozenset[str]:
    """SPLITSERVE_<OPTION> variables meant for `up` itself (and its --config file): not for its children,
    whose parsers would read them as their own options."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    names = {f"SPLITSERVE_{a.dest.upper()}" for a in parser._actions if a.option_strings}
    return frozenset(names | {"SPLITSERVE_CONFIG"})


def _say(text: str) -> None:
    print(text, flush=True)


async def _main(config: UpConfig, *, show_logs: bool, drop_env: frozenset[str] = frozenset()) -> int:
    is_temp = config.work_dir is None
    work_dir = Path(tempfile.mkdtemp(prefix="splitserve-up-")) if is_temp else config.work_dir
    work_dir.mkdir(parents=True, exist_ok=True)
    cluster = LocalCluster(config, work_dir, progress=_say, echo_children=show_logs, drop_env=drop_env)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    model = str(config.model) if config.model else "the embedded default model"
    _say(f"splitserve up: {model}, shards {config.inference_shards}, {config.engine} engine; logs in {cluster.log_dir}")
    code = 0
    start = asyncio.create_task(cluster.start())
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({start, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not start.done():  # Ctrl-C during start-up
            start.cancel()
            with contextlib.suppress(asyncio.CancelledError, StartupError):
                await start
            _say("splitserve up: interrupted during start-up")
            return 130
        start.result()  # StartupError -> below
        _print_ready(cluster)
        exited = asyncio.create_task(supervise(cluster, _say, config.max_restarts))
        await asyncio.wait({exited, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if exited.done():
            child = exited.result()
            again = f" (restarted {config.max_restarts} times within a minute)" if config.max_restarts else ""
            _say(f"splitserve up: {child.exit_message()}{again}\nstopping the cluster")
            code = 1
        else:
            exited.cancel()
            _say("splitserve up: stopping (workers finish their requests first) ...")
    except StartupError as e:
        _say(f"splitserve up: error: {e}")
        code = 1
    finally:
        stopping.cancel()
        left = await asyncio.shield(cluster.stop())
        if left:
            _say(f"splitserve up: processes of {', '.join(left)} did not exit")
            code = code or 1
        elif code == 0 and is_temp:
            shutil.rmtree(work_dir, ignore_errors=True)
    if code == 0:
        _say("splitserve up: stopped; no process left running")
    else:
        _say(f"splitserve up: logs kept in {cluster.log_dir}")
    return code


def _print_ready(cluster: LocalCluster) -> None:
    """The banner. Its SDK line is a constructor to paste: it names the tokenizer, without which
    the client takes token ids only and refuses text prompts."""
    e = cluster.endpoints
    tokenizer = str(cluster.config.model) if cluster.config.model else "default"
    _say(
        f"\nsplitserve is up.\n"
        f"  OpenAI API   {e.gateway_url}/v1   (docs {e.gateway_url}/docs, metrics {e.gateway_url}/metrics)\n"
        f"  gRPC SDK     splitserve.client.Client({e.router!r}, control_plane={e.control_plane!r}, "
        f"tokenizer={tokenizer!r})\n"
        f"  Press Ctrl-C to stop.\n"
        f"READY {e.gateway_url}"
    )
