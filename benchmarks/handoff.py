"""Handoff throughput and exposed time between two processes, beside a plain copy, in one run.

A source process holds a KV pool (Llama-3.2-1B KV shape: 16 layers, 8 kv heads, head_dim 64,
block 16, bf16) and exposes it; a destination process pulls one request's blocks per the
transfer plan, for 1k / 8k / 32k-token prompts, per transport:

- throughput: GB/s of a pull of already-written KV, and its ratio to a copy of the same bytes
  measured in the same run, interleaved with the pulls in alternating order (`ratio`: best against best of
  --repeats each; `med`: median against median) (CPU: a copy between two host buffers
  holding data, with --threads threads, default 1 = memcpy; GPU: device-to-device). `reshard` pulls into a tp=2 rank (half the
  heads: a strided pattern).
- exposed: the source "prefills" — one layer every prompt_len / --prefill-tok-s / 16 seconds
  (a modelled compute time; it sleeps, so it takes no CPU from the pull), publishing each
  layer on its progress board — and the destination pulls. `off`: the pull starts when
  prefill ends; `layerwise`: it streams from prefill start (engine/transfer/streaming.py).
  Exposed = the handoff's time after prefill ends, i.e. transfer time not hidden by compute.
  torch_dist pushes instead: `off` after prefill ends, `layerwise` each layer once computed
  (`send_plan(..., layer_ready=)`), into receives posted at prefill start.

    python benchmarks/handoff.py                         # CPU: shm, nixl, torch_dist (gloo; and TCP's ceiling)
    python benchmarks/handoff.py --transports nixl,nixl_strided --no-exposed   # NIXL reshards: staged vs strided
    python benchmarks/handoff.py --transports nixl,nixl_packed   # NIXL reshards: staged vs packed on the source
    python benchmarks/handoff.py --gpu                   # H200: cuda_ipc, nixl (VRAM); NCCL needs 2 GPUs
    python benchmarks/handoff.py --gpu --ucx-tls cuda_ipc,cuda_copy,tcp,self

nixl_packed reshards: the source packs the head slices (engine/transfer/source_pack.py) before
the timed pull, as a prefill worker does layer by layer under its compute; `source pack ms` is
that packing's own time (nan: nothing packed).
cuda_ipc has no layer-wise mode (no board: its whole 8k pull takes ~0.2 ms): its exposed columns read n/a.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))  # handoff_procs, also under `python -P` from elsewhere
from handoff_procs import BLOCK, LAYERS, STREAMING, destination, source, tcp_ceiling  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help="both processes on cuda:0")
    p.add_argument("--tokens", default="1024,8192,32768", help="prompt lengths")
    p.add_argument("--transports", default=None,
                   help="comma list (default: shm,nixl,torch_dist on CPU; cuda_ipc,nixl on GPU)")
    p.add_argument("--ucx-tls", default=None, help="UCX_TLS for the NIXL runs")
    p.add_argument("--prefill-tok-s", type=float, default=20000.0,
                   help="modelled prefill speed for the exposed-time runs (tokens/s over all layers)")
    p.add_argument("--repeats", type=int, default=4, help="timed repetitions per row (best is reported)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of both processes (the pulls' local copies and the plain copy use them alike; "
                        "1 = a plain memcpy, and robust on a shared machine)")
    p.add_argument("--no-exposed", action="store_true", help="throughput only: skip the exposed-time runs")
    p.add_argument("--cpus", default=None, metavar="SRC,DST",
                   help="pin the source and destination processes to these CPU cores (steadier µs-scale GPU "
                        "pulls: a 1k-token pull's host time moved with the core each run landed on)")
    args = p.parse_args()
    device = "cuda" if args.gpu else "cpu"
    kinds = (args.transports or ("cuda_ipc,nixl" if args.gpu else "shm,nixl_packed,torch_dist")).split(",")
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls
    os.environ.setdefault("UCX_NET_DEVICES", "lo" if not args.gpu else os.environ.get("UCX_NET_DEVICES", "all"))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  {LAYERS} layers, block {BLOCK}, bf16, {args.threads} "
          f"thread(s), prefill modelled at {args.prefill_tok_s:,.0f} tok/s, load average {os.getloadavg()[0]:.1f}")
    print(f"{'transport':>10} {'case':>8} {'tokens':>7} {'MB':>8} {'GB/s':>7} {'copy GB/s':>9} {'ratio':>6} {'med':>6} "
          f"{'prefill ms':>10} {'exposed off ms':>14} {'exposed layerwise ms':>20} {'source pack ms':>14}")
    for kind in kinds:
        with tempfile.TemporaryDirectory() as store_dir:
            a, b = ctx.Pipe()
            out = ctx.Queue()
            src = ctx.Process(target=source, args=(a, kind, max(tokens) // BLOCK, device, store_dir, args.threads))
            dst = ctx.Process(target=destination,
                              args=(b, kind, tokens, device, store_dir, args.prefill_tok_s, args.repeats,
                                    not args.no_exposed, args.threads, out))
            src.start()
            dst.start()
            if args.cpus:  # set as they start: threads they create later (UCX, NIXL) inherit it
                for proc, cpu in zip((src, dst), args.cpus.split(","), strict=True):
                    os.sched_setaffinity(proc.pid, {int(cpu)})
            try:
                rows = out.get(timeout=900)
            except Exception as exc:  # report and go on with the next transport
                print(f"{kind:>10} failed: {exc!r}")
                rows = []
            for proc in (src, dst):
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
            for r in rows:
                off = f"{r['exposed_off'] * 1e3:.1f}" if r["exposed_off"] is not None else "n/a"
                on = f"{r['exposed_on'] * 1e3:.1f}" if r["exposed_on"] is not None else "n/a"
                print(f"{kind:>10} {r['case']:>8} {r['tokens']:>7} {r['bytes'] / 1e6:>8.1f} {r['gbps']:>7.2f} "
                      f"{r['copy_gbps']:>9.2f} {r['gbps'] / r['copy_gbps']:>6.1%} {r['median_ratio']:>6.1%} "
                      f"{r['prefill_s'] * 1e3:>10.1f} "
                      f"{off:>14} {on:>20} {r['pack_ms']:>14.1f}")
    print(f"layer-wise streaming available for: {', '.join(k for k in kinds if k in STREAMING or k == 'torch_dist') or 'none'}")
    if "torch_dist" in kinds and not args.gpu:  # gloo's only transport is TCP: its ceiling, in the same run
        tcp, copy = tcp_ceiling(ctx)
        print(f"raw TCP over loopback between two processes {tcp:.2f} GB/s = {tcp / copy:.1%} of a 1-thread copy "
              f"({copy:.2f} GB/s): the most torch_dist over gloo could reach here")


if __name__ == "__main__":
    main()
