"""Command-line options shared by `splitserve prefill-worker` and `decode-worker`."""

from __future__ import annotations

import argparse

from splitserve.engine.generate_cli import add_attention_backend_argument
from splitserve.engine.sim_engine import SimConfig
from splitserve.engine.worker_runtime import WorkerSpec
from splitserve.telemetry.metrics import add_metrics_arguments


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="Hugging Face checkpoint directory (default: the embedded model)")
    p.add_argument("--listen", default="127.0.0.1:0", help="gRPC address to bind (default 127.0.0.1:0 = any free port)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of this worker (one process each)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages of this worker (one process each)")
    p.add_argument(
        "--transport",
        default="nixl",
        choices=["nixl", "torch_dist", "cuda_ipc", "shm", "inproc"],
        help="KV transport (default nixl over UCX; VRAM pools on one host are mapped over CUDA IPC by it, "
        "SPLITSERVE_NIXL_CUDA_IPC=0 turns that off); cuda_ipc: same-host GPUs, the decode side maps the prefill pool; shm: same-host CPU pools, "
        "the decode side maps the prefill pool from shared memory; torch_dist: the prefill worker pushes over a gloo (CPU) / NCCL (GPU) "
        "group of the pair, same host only, both workers must use it",
    )
    p.add_argument(
        "--layerwise",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="layer-wise KV streaming (engine/config.py TransferConfig.layerwise): prefill previews each handoff and "
        "marks each layer on a progress board as its forward pass writes it; the decode worker prefetches layers "
        "meanwhile (nixl, shm; cuda_ipc and torch_dist ignore it). Faster when prefill and decode run on separate "
        "compute (the default, on), slower when they share CPU cores: --no-layerwise there (benchmarks/RESULTS.md)",
    )
    p.add_argument(
        "--pack-for-tp",
        type=_pack_for_tp,
        default="auto",
        metavar="auto|N",
        help="prefill role, --transport nixl, one rank: pack each handoff's KV head slices for the decode worker's TP "
        "size (named by the router per request; N when it names none) while the layers are written, so the decode "
        "ranks read contiguous memory (engine/config.py TransferConfig.pack_for_tp; costs up to a quarter of the KV "
        "pool in packed memory). Default auto: on when the cluster's --inference-shards spec (from --etcd) has a "
        "decode group of TP > 1, packing for its largest TP by default (a TP the model's kv heads do not fit is "
        "warned about and skipped; an explicit N that does not fit is refused at start); 0: off",
    )
    p.add_argument("--etcd", default=None, help="HOST:PORT of etcd: register with the control plane (optional)")
    p.add_argument("--cluster", default="default", help="cluster name in etcd (default 'default')")
    p.add_argument("--device", default="auto", help="auto (CUDA if present, or $SPLITSERVE_AUTO_DEVICE when set), cpu or cuda")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"], help="weights/KV dtype")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16)")
    add_attention_backend_argument(p)
    p.add_argument("--buffer-size-gb", type=float, default=0.25, help="KV cache budget per rank in GiB")
    p.add_argument("--num-blocks", type=int, default=None, help="exact KV block count (overrides --buffer-size-gb)")
    p.add_argument("--max-tokens", type=int, default=2048, help="token budget per engine step")
    p.add_argument("--max-requests", type=int, default=64, help="requests running at once")
    p.add_argument("--handoff-lease-s", type=float, default=30.0, help="seconds a pinned handoff waits for its ack")
    p.add_argument("--grace-s", type=float, default=10.0, help="seconds to finish in-flight work on SIGTERM")
    p.add_argument(
        "--warm-up",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="before serving, run a few dummy requests through the engine at each decode batch-size bucket "
        "(engine/warmup.py): Triton compiles, CUDA graph captures and first-use costs happen then, not in the "
        "first clients' requests; nothing of them stays (no cached prefix, no KV event). Default on",
    )
    add_metrics_arguments(p)
    sim = p.add_argument_group("simulated engine (control-plane / router tests with many workers on a CPU)")
    sim.add_argument(
        "--engine",
        default="torch",
        choices=["torch", "sim"],
        help="torch runs the model; sim runs none: modelled timing, a real block pool and prefix cache, "
        "pseudo-tokens, the same gRPC. sim reads only --model's config.json (default: a Llama-3-8B shape), "
        "runs one rank and ignores --transport",
    )
    sim.add_argument("--sim-prefill-tokens-per-s", type=float, default=SimConfig.prefill_tokens_per_s, help="modelled prefill throughput (default %(default)s)")
    sim.add_argument("--sim-decode-step-s", type=float, default=SimConfig.decode_step_s, help="modelled seconds of a step that decodes, any batch (default %(default)s)")
    sim.add_argument("--sim-transfer-gbps", type=float, default=SimConfig.transfer_gbps, help="modelled KV pull bandwidth in GB/s (default %(default)s)")
    sim.add_argument("--sim-vocab-size", type=int, default=None, help="pseudo-tokens lie in [0, N) (default: the model's vocabulary)")

def _pack_for_tp(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected auto or a TP size >= 0 (0 = off), got {text!r}")
    return int(text)


def spec_from_args(args: argparse.Namespace, role: str) -> WorkerSpec:
    options = dict(
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        block_size_tokens=args.block_size,
        buffer_size_gb=args.buffer_size_gb,
        num_blocks=args.num_blocks,
        max_tokens=args.max_tokens,
        max_requests=args.max_requests,
        handoff_lease_s=args.handoff_lease_s,
        layerwise=args.layerwise,
        pack_for_tp=args.pack_for_tp,
    )
    return WorkerSpec(
        model=args.model,
        role=role,
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        transport=args.transport,
        address=args.listen.rsplit(":", 1)[0],
        engine_options=options,
        engine=args.engine,
        warm_up=args.warm_up,
        sim=SimConfig(
            prefill_tokens_per_s=args.sim_prefill_tokens_per_s,
            decode_step_s=args.sim_decode_step_s,
            transfer_gbps=args.sim_transfer_gbps,
            vocab_size=args.sim_vocab_size,
        ),
    )


def run_worker(args: argparse.Namespace, role: str, hooks_factory, add_service) -> int:
    """The body of `splitserve prefill-worker` / `decode-worker`."""
    from splitserve.engine.worker_server import run_worker_main, serve_worker

    def start():
        spec = spec_from_args(args, role)
        return serve_worker(
            spec, args.listen, hooks_factory, add_service, etcd=args.etcd, cluster=args.cluster, grace_s=args.grace_s,
            metrics_port=args.metrics_port, metrics_host=args.metrics_host,
        )  # fmt: skip

    return run_worker_main(start, f"splitserve-{role}-worker")
