"""A minimal worker process for tests: registers, prints its slot ids, then idles until killed.

    python tests/control_plane/worker_process.py --etcd HOST:PORT --cluster NAME --prefix /p \
        --worker-id w0 --address 127.0.0.1:7000 [--role decode] [--ttl 2]
"""

import argparse
import asyncio

from splitserve.control_plane.keys import ClusterKeys
from splitserve.control_plane.shard_spec import Role
from splitserve.control_plane.worker_registration import WorkerRegistration


async def main(args: argparse.Namespace) -> None:
    registration = WorkerRegistration(
        etcd=args.etcd, address=args.address, role=Role(args.role) if args.role else None,
        worker_id=args.worker_id, keys=ClusterKeys(args.cluster, args.prefix), lease_ttl_s=args.ttl,
    )  # fmt: skip
    assignment = await registration.start(timeout_s=20)
    print("assigned", ",".join(map(str, assignment.slot_ids)), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for flag in ("--etcd", "--cluster", "--prefix", "--worker-id", "--address"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--role")
    parser.add_argument("--ttl", type=int, default=2)
    asyncio.run(main(parser.parse_args()))
