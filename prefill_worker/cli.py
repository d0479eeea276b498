"""Run a prefill worker: computes prompts' KV, pins it, and hands it to decode workers.

Serves splitserve.v1.PrefillWorker + grpc.health.v1 on --listen and prints
`READY <address>` when serving. With --tp/--pp it starts one process per rank.
With --etcd it registers with the control plane and takes a prefill slot.
"""

from __future__ import annotations

import argparse

from splitserve.engine.worker_cli import add_worker_arguments, spec_from_args


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_worker_arguments(p)


def run(args: argparse.Namespace) -> int:
    from splitserve.engine.worker_server import run_worker_main, serve_worker
    from splitserve.prefill_worker.hooks import prefill_hooks
    from splitserve.prefill_worker.service import add_prefill_service

    def start():
        spec = spec_from_args(args, "prefill")
        return serve_worker(
            spec, args.listen, prefill_hooks, add_prefill_service, etcd=args.etcd, cluster=args.cluster, grace_s=args.grace_s
        )

    return run_worker_main(start)
