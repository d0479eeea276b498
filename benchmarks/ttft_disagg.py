"""TTFT with prefill and decode in separate worker processes ÷ TTFT aggregated, in one run.

Starts a prefill worker and a decode worker (`splitserve prefill-worker|decode-worker`,
real gRPC, real processes, both on the same GPU, CUDA-IPC handoff) on the Llama-3.2-1B
shape with random bf16 weights, and drives them as the router does:

- aggregated: `Decode` without a handoff — the decode worker prefills and samples the
  first token itself; TTFT = time to its first streamed token.
- disaggregated: `PrefillStream` on the prefill worker, as the router calls it; TTFT = time
  to its first_token event (the router sends that token to the client at once, while the
  worker still checksums, describes and pins the KV). Then `Decode` with the handoff of the
  stream's final response: "decode ready" = time until the decode worker has imported the
  KV and streamed. The prefill worker's own timing (queue, compute, first token sent,
  publish, handler) comes from that response.

Prompts are fresh random tokens per request (no prefix-cache hits); medians over --reps, and
the median (with quartiles) of each rep's own ratio — its two requests ran back to back, so
drift between reps cancels in it.

    python3 benchmarks/device_env.py && PYTHONPATH=/tmp/site python3 benchmarks/ttft_disagg.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine import make_checkpoint  # noqa: E402

CFG = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
           num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072)


def start_worker(kind: str, model: str, flags: list[str], gpus: str | None = None) -> tuple[subprocess.Popen, str]:
    """Start a worker process; (process, its gRPC address) once it prints READY.
    `gpus`: its CUDA_VISIBLE_DEVICES (default: inherited)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    proc = subprocess.Popen([sys.executable, "-m", "splitserve", kind, "--model", model, *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    address: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            if not address and line.startswith("READY "):
                address.append(line.split()[1])
                ready.set()
            elif "Error" in line or "Traceback" in line:
                print(f"[{kind}] {line}", end="")
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    ready.wait(600)
    if not address:
        proc.kill()
        raise SystemExit(f"{kind} did not start")
    return proc, address[0]


def stop_workers(procs) -> None:
    """SIGTERM every worker (they drain at once with nothing in flight), then wait; kill the stragglers."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    import grpc

    from splitserve.engine.sampling_params import SamplingParams
    from splitserve.engine.wire import sampling_to_proto
    from splitserve.proto.v1 import (
        decode_worker_pb2,
        decode_worker_pb2_grpc,
        prefill_worker_pb2,
        prefill_worker_pb2_grpc,
    )

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="prompt length")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--transport", default="cuda_ipc")
    p.add_argument("--worker-flag", action="append", default=[], metavar="FLAG",
                   help="extra flag for both workers (repeatable), e.g. --worker-flag=--no-layerwise")
    args = p.parse_args()
    flags = ["--device", "cuda", "--dtype", "bfloat16", "--transport", args.transport, "--block-size", "16",
             "--buffer-size-gb", "16", "--max-tokens", str(max(8192, args.tokens)), "--max-requests", "8",
             *args.worker_flag]
    g = torch.Generator().manual_seed(0)
    sp = sampling_to_proto(SamplingParams(num_tokens_to_generate=4, temperature=0.0, ignore_eos=True))
    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(Path(tmp), CFG, torch.bfloat16, "cuda")
        prefill_proc, prefill_addr = start_worker("prefill-worker", tmp, flags)
        decode_proc, decode_addr = start_worker("decode-worker", tmp, flags)
        try:
            with grpc.insecure_channel(prefill_addr) as pc, grpc.insecure_channel(decode_addr) as dc:
                prefill = prefill_worker_pb2_grpc.PrefillWorkerStub(pc)
                decode = decode_worker_pb2_grpc.DecodeWorkerStub(dc)

                def prompt() -> list[int]:
                    return torch.randint(10, 100000, (args.tokens,), generator=g).tolist()

                def aggregated(rid: str) -> float:
                    t0 = time.perf_counter()
                    stream = decode.Decode(decode_worker_pb2.DecodeRequest(request_id=rid, token_ids=prompt(),
                                                                           sampling_params=sp), timeout=120)
                    first = None
                    for chunk in stream:
                        if first is None and chunk.token_ids:
                            first = time.perf_counter() - t0
                    return first

                def disaggregated(rid: str) -> tuple[float, float]:
                    ids = prompt()
                    t0 = time.perf_counter()
                    ttft, resp = None, None
                    for event in prefill.PrefillStream(prefill_worker_pb2.PrefillRequest(
                            request_id=rid, token_ids=ids, sampling_params=sp), timeout=120):
                        if event.WhichOneof("event") == "first_token":
                            ttft = time.perf_counter() - t0
                        else:
                            resp = event.response
                    t = resp.timing
                    phases.append((t.queue_ms, t.compute_ms, t.first_token_ms, t.publish_ms, t.handler_ms))
                    ready, sent = None, time.perf_counter() - t0
                    for chunk in decode.Decode(decode_worker_pb2.DecodeRequest(
                            request_id=rid, token_ids=ids, sampling_params=sp, handoff=resp.handoff,
                            prefill_address=prefill_addr), timeout=120):
                        if ready is None and chunk.token_ids:
                            ready = time.perf_counter() - t0
                        if chunk.HasField("timing"):
                            dt = chunk.timing
                            decode_phases.append((sent * 1e3, dt.queue_ms, dt.transfer_ms, dt.transfer_seconds * 1e3,
                                                  dt.first_step_ms, dt.first_chunk_ms))
                    return ttft, ready

                phases: list[tuple[float, ...]] = []
                decode_phases: list[tuple[float, ...]] = []
                for i in range(2):  # warm-up: kernels compile, graphs capture, IPC handles open
                    aggregated(f"warm-a{i}")
                    disaggregated(f"warm-d{i}")
                agg, dis, ready = [], [], []
                phases.clear()
                decode_phases.clear()
                for i in range(args.reps):  # interleaved: drift hits both alike
                    agg.append(aggregated(f"a{i}"))
                    t, r = disaggregated(f"d{i}")
                    dis.append(t)
                    ready.append(r)
        finally:
            stop_workers((prefill_proc, decode_proc))
    a, d, r = (statistics.median(x) * 1e3 for x in (agg, dis, ready))
    print(f"prompt {args.tokens} tokens, transport {args.transport} {' '.join(args.worker_flag)}, {args.reps} reps "
          f"(medians)")
    print(f"{'TTFT aggregated ms':>20} {'TTFT disagg ms':>16} {'disagg/agg - 1':>15} {'decode ready ms':>16} {'ready/agg - 1':>14}")
    print(f"{a:>20.2f} {d:>16.2f} {d / a - 1:>+15.2%} {r:>16.2f} {r / a - 1:>+14.2%}")
    paired = sorted(x / y - 1 for x, y in zip(dis, agg, strict=True))  # each rep's pair ran back to back
    quart = statistics.quantiles(paired, n=4) if len(paired) >= 2 else [paired[0]] * 3
    print(f"paired disagg/agg - 1 per rep: median {statistics.median(paired):+.2%}, quartiles {quart[0]:+.2%} / "
          f"{quart[2]:+.2%}")
    q, c, f, pub, h = (statistics.median(x) for x in zip(*phases, strict=True))
    print(f"prefill worker's own timing (medians, ms): queue {q:.2f}  compute {c:.2f}  first token sent {f:.2f}  "
          f"publish {pub:.2f} (off the TTFT path)  handler {h:.2f}  -> outside the worker (gRPC, client) {d - f:.2f}")
    sent, dq, dx, pull, step, chunk = (statistics.median(x) for x in zip(*decode_phases, strict=True))
    print(f"decode side (medians, ms): Decode called at {sent:.2f} after the request start; on the worker: queue "
          f"{dq:.2f}  import {dx:.2f} (of which the pull {pull:.2f})  import to first token {step:.2f}  first chunk "
          f"sent at {chunk:.2f}")
    print("all aggregated ms:", " ".join(f"{x * 1e3:.1f}" for x in agg))
    print("all disagg ms:    ", " ".join(f"{x * 1e3:.1f}" for x in dis))


if __name__ == "__main__":
    main()
