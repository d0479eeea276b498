"""Command-line options shared by `splitserve prefill-worker` and `decode-worker`."""

from __future__ import annotations

import argparse

from splitserve.engine.worker_runtime import WorkerSpec


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="Hugging Face checkpoint directory (default: the embedded model)")
    p.add_argument("--listen", default="127.0.0.1:0", help="gRPC address to bind (default 127.0.0.1:0 = any free port)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of this worker (one process each)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages of this worker (one process each)")
    p.add_argument("--transport", default="nixl", choices=["nixl", "inproc"], help="KV transport (default nixl over UCX)")
    p.add_argument("--etcd", default=None, help="HOST:PORT of etcd: register with the control plane (optional)")
    p.add_argument("--cluster", default="default", help="cluster name in etcd (default 'default')")
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu or cuda")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"], help="weights/KV dtype")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16)")
    p.add_argument("--buffer-size-gb", type=float, default=0.25, help="KV cache budget per rank in GiB")
    p.add_argument("--num-blocks", type=int, default=None, help="exact KV block count (overrides --buffer-size-gb)")
    p.add_argument("--max-tokens", type=int, default=2048, help="token budget per engine step")
    p.add_argument("--max-requests", type=int, default=64, help="requests running at once")
    p.add_argument("--handoff-lease-s", type=float, default=30.0, help="seconds a pinned handoff waits for its ack")
    p.add_argument("--grace-s", type=float, default=10.0, help="seconds to finish in-flight work on SIGTERM")


def spec_from_args(args: argparse.Namespace, role: str) -> WorkerSpec:
    options = dict(
        device=args.device,
        dtype=args.dtype,
        block_size_tokens=args.block_size,
        buffer_size_gb=args.buffer_size_gb,
        num_blocks=args.num_blocks,
        max_tokens=args.max_tokens,
        max_requests=args.max_requests,
        handoff_lease_s=args.handoff_lease_s,
    )
    return WorkerSpec(
        model=args.model,
        role=role,
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        transport=args.transport,
        address=args.listen.rsplit(":", 1)[0],
        engine_options=options,
    )
