"""Run a prefill worker: computes prompts' KV, pins it, and hands it to decode workers.

Serves splitserve.v1.PrefillWorker + grpc.health.v1 on --listen and prints
`READY <address>` when serving. With --tp/--pp it starts one process per rank.
With --etcd it registers with the control plane and takes a prefill slot.
"""

from __future__ import annotations

import argparse

from splitserve.engine.worker_cli import add_worker_arguments, run_worker

add_arguments = add_worker_arguments


def run(args: argparse.Namespace) -> int:
    from splitserve.prefill_worker.hooks import prefill_hooks
    from splitserve.prefill_worker.service import add_prefill_service

    return run_worker(args, "prefill", prefill_hooks, add_prefill_service)
