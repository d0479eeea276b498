"""Run a decode worker: imports handed-off KV (or prefills itself) and streams tokens.

Serves splitserve.v1.DecodeWorker + grpc.health.v1 on --listen and prints
`READY <address>` when serving. With --tp/--pp it starts one process per rank.
With --etcd it registers with the control plane and takes a decode slot.
"""

from __future__ import annotations

import argparse

from splitserve.engine.worker_cli import add_worker_arguments, run_worker

add_arguments = add_worker_arguments


def run(args: argparse.Namespace) -> int:
    from splitserve.decode_worker.hooks import decode_hooks
    from splitserve.decode_worker.service import add_decode_service

    return run_worker(args, "decode", decode_hooks, add_decode_service)
