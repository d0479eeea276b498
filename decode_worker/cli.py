"""Run a decode worker: imports handed-off KV (or prefills itself) and streams tokens.

Serves splitserve.v1.DecodeWorker + grpc.health.v1 on --listen and prints
`READY <address>` when serving. With --tp/--pp it starts one process per rank.
With --etcd it registers with the control plane and takes a decode slot.
"""

from __future__ import annotations

import argparse

from splitserve.engine.worker_cli import add_worker_arguments, spec_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_worker_arguments(p)


def run(args: argparse.Namespace) -> int:
    from splitserve.decode_worker.hooks import decode_hooks
    from splitserve.decode_worker.service import add_decode_service
    from splitserve.engine.worker_server import run_worker_main, serve_worker

    def start():
        spec = spec_from_args(args, "decode")
        return serve_worker(
            spec, args.listen, decode_hooks, add_decode_service, etcd=args.etcd, cluster=args.cluster, grace_s=args.grace_s
        )

    return run_worker_main(start)
