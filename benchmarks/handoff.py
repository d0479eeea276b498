"""Handoff throughput between two processes beside a plain copy, in one run.

A source process holds a KV pool (Llama-3.2-1B KV shape: 16 layers, 8 kv
heads, head_dim 64, block 16, bf16) and exposes it; a destination process
pulls one request's blocks per the transfer plan, for 1k / 8k / 32k-token
prompts, per transport, and prints GB/s and the ratio to a copy of the same
bytes measured in the same run (CPU: memcpy between two host buffers; GPU:
device-to-device). `reshard` pulls into a tp=2 rank (half the heads: strided).

    python benchmarks/handoff.py                         # CPU: nixl, torch_dist (gloo)
    python benchmarks/handoff.py --gpu                   # H200: cuda_ipc, nixl (VRAM); NCCL needs 2 GPUs
    python benchmarks/handoff.py --gpu --ucx-tls cuda_ipc,cuda_copy,tcp,self

Layer-wise streaming is not implemented yet, so there is no streaming column.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from datetime import timedelta

import torch
import torch.multiprocessing as mp

LAYERS, HEADS, HEAD_DIM, BLOCK = 16, 8, 64, 16


def layout(tp: int = 1):
    from splitserve.engine.transfer.layout import KVLayout

    return KVLayout(dtype="bfloat16", block_size=BLOCK, tp=tp, pp=1, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM)


def pool(num_blocks: int, heads: int, device: str) -> list[torch.Tensor]:
    return [torch.randn(2, num_blocks, heads, BLOCK, HEAD_DIM, device=device).to(torch.bfloat16) for _ in range(LAYERS)]


def make(kind: str):
    if kind == "nixl":
        from splitserve.engine.transfer.nixl_transport import NixlTransport

        return NixlTransport()
    from splitserve.engine.transfer.cuda_ipc import CudaIpcTransport

    return CudaIpcTransport()


def pair_group(store_dir: str, rank: int, device: str):
    store = torch.distributed.FileStore(os.path.join(store_dir, "store"), 2)
    if device == "cuda":
        return torch.distributed.ProcessGroupNCCL(store, rank, 2)
    return torch.distributed.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))


def source(conn, kind: str, max_blocks: int, device: str, store_dir: str) -> None:
    torch.manual_seed(0)
    kv = pool(max_blocks, HEADS, device)
    if kind == "torch_dist":
        from splitserve.engine.transfer.torch_dist import send_plan

        conn.send(b"")  # first: the destination joins the group after this
        group = pair_group(store_dir, 0, device)
        while (msg := conn.recv()) is not None:
            plan = msg
            send_plan(plan, 0, kv, {0: 1}, group=group)
        return
    transport = make(kind)
    conn.send(transport.expose(kv))
    conn.recv()  # wait until the destination is done
    transport.close()


def destination(conn, kind: str, tokens: list[int], device: str, store_dir: str, out) -> None:
    from splitserve.engine.transfer.plan import build_plan

    meta = conn.recv()
    group = pair_group(store_dir, 1, device) if kind == "torch_dist" else None
    transport = None if kind == "torch_dist" else make(kind)
    rows = []
    for n_tokens in tokens:
        n = n_tokens // BLOCK
        for case, dst_tp in (("same", 1), ("reshard", 2)):
            dst_layout = layout(dst_tp)
            kv = pool(n, HEADS // dst_tp, device)
            plan = build_plan(layout(1), dst_layout, {0: list(range(n))}, {r: list(range(n)) for r in range(dst_tp)})
            times = []
            for _ in range(4):
                t0 = time.perf_counter()
                if kind == "torch_dist":
                    from splitserve.engine.transfer.torch_dist import recv_plan

                    # only dst rank 0 exists here: give the source a plan with just its ops
                    conn.send(_only_rank0(plan))
                    stats = recv_plan(_only_rank0(plan), 0, kv, {0: 0}, group=group)
                else:
                    stats = transport.pull(plan, 0, {0: meta}, kv)
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            moved = stats.num_bytes
            best = min(times[1:])
            a = torch.empty(moved, dtype=torch.uint8, device=device)
            b = torch.empty_like(a)
            b.copy_(a)
            copy_times = []
            for _ in range(5):
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                b.copy_(a)
                if device == "cuda":
                    torch.cuda.synchronize()
                copy_times.append(time.perf_counter() - t0)
            copy = min(copy_times)
            rows.append((kind, case, n_tokens, moved, moved / best / 1e9, moved / copy / 1e9, copy / best))
    if kind == "torch_dist":
        conn.send(None)
    else:
        conn.send(b"done")
    out.put(rows)


def _only_rank0(plan):
    from dataclasses import replace

    return replace(plan, ops=tuple(op for op in plan.ops if op.dst_rank == 0))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help="both processes on cuda:0")
    p.add_argument("--tokens", default="1024,8192,32768", help="prompt lengths")
    p.add_argument("--transports", default=None, help="comma list (default: nixl,torch_dist on CPU; cuda_ipc,nixl,torch_dist on GPU)")
    p.add_argument("--ucx-tls", default=None, help="UCX_TLS for the NIXL runs")
    args = p.parse_args()
    device = "cuda" if args.gpu else "cpu"
    kinds = (args.transports or ("cuda_ipc,nixl" if args.gpu else "nixl,torch_dist")).split(",")
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls
    os.environ.setdefault("UCX_NET_DEVICES", "lo" if not args.gpu else os.environ.get("UCX_NET_DEVICES", "all"))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    print(f"{'transport':>10} {'case':>8} {'tokens':>7} {'MB':>8} {'GB/s':>8} {'copy GB/s':>10} {'ratio':>6}")
    for kind in kinds:
        with tempfile.TemporaryDirectory() as store_dir:
            a, b = ctx.Pipe()
            out = ctx.Queue()
            src = ctx.Process(target=source, args=(a, kind, max(tokens) // BLOCK, device, store_dir))
            dst = ctx.Process(target=destination, args=(b, kind, tokens, device, store_dir, out))
            src.start()
            dst.start()
            try:
                rows = out.get(timeout=300)
            except Exception as exc:  # report and go on with the next transport
                print(f"{kind:>10} failed: {exc!r}")
                rows = []
            for proc in (src, dst):
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
            for kind_, case, n, moved, gbps, copy, ratio in rows:
                print(f"{kind_:>10} {case:>8} {n:>7} {moved / 1e6:>8.1f} {gbps:>8.2f} {copy:>10.2f} {ratio:>6.1%}")


if __name__ == "__main__":
    main()
