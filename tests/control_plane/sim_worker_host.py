"""Hosts many simulated workers in one process, for the scale test (test_sim_scale.py).

Each worker is a whole `serve_worker`, exactly what `splitserve prefill-worker
--engine sim` runs: its own gRPC server and health service, etcd lease and
control-plane registration, lifecycle follower, and SimEngine on its own engine
thread. Only the process is shared (one interpreter instead of 32: 128 Python
processes that each import torch do not fit on a 2-core CI machine).

    python tests/control_plane/sim_worker_host.py --etcd HOST:PORT --cluster NAME \
        --roles prefill,decode,... --ports 7001,7002,...

Prints `LOADED` once imported, waits for a line on stdin, then starts one
worker per (role, port) — each prints `READY <address>` — and stops them all
gracefully (drain, deregister) at stdin EOF; exits 1 if any worker failed.
"""

import argparse
import asyncio
import sys
import traceback

from splitserve.decode_worker.hooks import decode_hooks
from splitserve.decode_worker.service import add_decode_service
from splitserve.engine.sim_engine import SimConfig
from splitserve.engine.worker_runtime import WorkerSpec
from splitserve.engine.worker_server import serve_worker
from splitserve.prefill_worker.hooks import prefill_hooks
from splitserve.prefill_worker.service import add_prefill_service

SERVICES = {"prefill": (prefill_hooks, add_prefill_service), "decode": (decode_hooks, add_decode_service)}


def report_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        exc = task.exception()
        print(f"FAILED {task.get_name()}: {''.join(traceback.format_exception(exc))}", flush=True)


async def main(args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    roles, ports = args.roles.split(","), args.ports.split(",")
    if len(roles) != len(ports):
        raise SystemExit(f"{len(roles)} roles for {len(ports)} ports")
    sim = SimConfig(prefill_tokens_per_s=args.prefill_tokens_per_s, decode_step_s=args.decode_step_s)
    print("LOADED", flush=True)
    await stdin.readline()
    stop = asyncio.Event()
    tasks = []
    for role, port in zip(roles, ports, strict=True):
        hooks, add_service = SERVICES[role]
        spec = WorkerSpec(model=None, role=role, engine="sim", engine_options={"num_blocks": args.num_blocks}, sim=sim)
        worker = serve_worker(
            spec, f"127.0.0.1:{port}", hooks, add_service, etcd=args.etcd, cluster=args.cluster, grace_s=2.0, stop=stop
        )
        tasks.append(asyncio.create_task(worker, name=f"{role}@{port}"))
        tasks[-1].add_done_callback(report_failure)
    await stdin.read()  # EOF: stop every worker
    stop.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    num_failed = sum(isinstance(r, BaseException) for r in results)
    print(f"STOPPED {len(tasks) - num_failed} ok, {num_failed} failed", flush=True)
    return 1 if num_failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for flag in ("--etcd", "--cluster", "--roles", "--ports"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--prefill-tokens-per-s", type=float, default=20_000.0)
    parser.add_argument("--decode-step-s", type=float, default=0.005)
    sys.exit(asyncio.run(main(parser.parse_args())))
