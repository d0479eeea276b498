"""Served layer-wise streaming on vs off, side by side in one run: real worker processes, real gRPC.

Two prefill/decode worker pairs run at once, both with `--layerwise`. Each prompt is sent twice,
once per pair: "on" as the router drives layer-wise streaming — `PrefillStream`, its
`handoff_started` preview to the decode worker's `Prefetch` at once, the response's handoff to
`Decode` — and "off" the same without the Prefetch (the pull starts when Decode comes, after
prefill, as without `--layerwise`). Which pair runs "on" alternates per prompt, and so does the
order, so neither a pair's placement nor machine drift favours a mode (an A/A run with both
modes "off" differed by up to 7% between two pairs on a 2-core machine). Per request:

- decode ready: request start → the decode worker's first chunk (KV imported and verified);
- exposed import: the decode worker's own import time (`DecodeTiming.transfer_ms`): the whole
  pull when off; when on, only the wait for layers prefill had not yet written, plus verification.

The model has the KV shape of Llama-3.2-1B (16 layers, 8 kv heads of 64: 64 KB per token in
fp32 on CPU) with small projections, so a CPU prefill stays short; fresh random prompts per
request (no prefix-cache hits).

    python benchmarks/layerwise_served.py                       # CPU, shm; 512 / 2048-token prompts
    python benchmarks/layerwise_served.py --transport nixl --tokens 1024,4096 --reps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from ttft_disagg import start_worker, stop_workers  # noqa: E402

from engine import make_checkpoint  # noqa: E402

CFG = dict(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=16,
           num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=32768)


def run_one(stubs, prefill_addr: str, rid: str, ids: list[int], sp, prefetch: bool
            ) -> tuple[float, float, float, bool, float]:
    """(first token s, decode ready s, decode import ms, prefetched, the transport's pull ms) of one request."""
    from splitserve.proto.v1 import decode_worker_pb2, prefill_worker_pb2

    prefill, decode = stubs
    t0 = time.perf_counter()
    first = None
    response = None
    for event in prefill.PrefillStream(prefill_worker_pb2.PrefillRequest(
            request_id=rid, token_ids=ids, sampling_params=sp), timeout=600):  # fmt: skip
        kind = event.WhichOneof("event")
        if kind == "handoff_started" and prefetch:
            decode.Prefetch(decode_worker_pb2.PrefetchRequest(request_id=rid, token_ids=ids,
                                                              handoff=event.handoff_started), timeout=30)  # fmt: skip
        elif kind == "first_token":
            first = time.perf_counter() - t0
        else:
            response = event.response
    ready, transfer_ms, prefetched, pull_ms = None, 0.0, False, 0.0
    for chunk in decode.Decode(decode_worker_pb2.DecodeRequest(
            request_id=rid, token_ids=ids, sampling_params=sp, handoff=response.handoff,
            prefill_address=prefill_addr), timeout=600):  # fmt: skip
        if ready is None and chunk.token_ids:
            ready = time.perf_counter() - t0
        if chunk.HasField("timing"):
            transfer_ms, prefetched = chunk.timing.transfer_ms, chunk.timing.prefetched
            pull_ms = 1e3 * chunk.timing.transfer_seconds
    return first, ready, transfer_ms, prefetched, pull_ms


def main() -> None:
    import grpc

    from splitserve.engine.sampling_params import SamplingParams
    from splitserve.engine.wire import sampling_to_proto
    from splitserve.proto.v1 import decode_worker_pb2_grpc, prefill_worker_pb2_grpc

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="512,2048", help="prompt lengths, comma-separated")
    p.add_argument("--reps", type=int, default=4, help="requests per prompt length, mode and pair (medians reported)")
    p.add_argument("--transport", default="shm", choices=["shm", "nixl"])
    p.add_argument("--split-cores", action="store_true",
                   help="prefill workers on the first half of the CPUs, decode workers on the other half, as on "
                        "separate hosts (otherwise every process shares every core, and the decode side's pulls "
                        "and checksums take CPU from the prefill they overlap)")
    args = p.parse_args()
    lengths = [int(x) for x in args.tokens.split(",")]
    longest = max(lengths)
    flags = ["--device", "cpu", "--dtype", "float32", "--transport", args.transport, "--block-size", "16",
             "--num-blocks", str(4 * (longest // 16 + 1) + 64), "--max-tokens", str(longest), "--max-requests", "4"]
    g = torch.Generator().manual_seed(0)
    sp = sampling_to_proto(SamplingParams(num_tokens_to_generate=2, temperature=0.0, ignore_eos=True))
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(Path(tmp), CFG, torch.float32, "cpu")
        try:
            pairs = []
            cpus = sorted(os.sched_getaffinity(0))
            halves = (set(cpus[: len(cpus) // 2]), set(cpus[len(cpus) // 2:])) if args.split_cores else (set(cpus),) * 2
            for _ in range(2):
                os.sched_setaffinity(0, halves[0])  # inherited by the worker and its threads
                pp, pa = start_worker("prefill-worker", tmp, flags + ["--layerwise"])
                os.sched_setaffinity(0, halves[1])
                dp, da = start_worker("decode-worker", tmp, flags + ["--layerwise"])
                os.sched_setaffinity(0, set(cpus))
                procs += [pp, dp]
                pairs.append((pa, da))
            channels = [(grpc.insecure_channel(a), grpc.insecure_channel(b)) for a, b in pairs]
            stubs = [(prefill_worker_pb2_grpc.PrefillWorkerStub(c[0]), decode_worker_pb2_grpc.DecodeWorkerStub(c[1]))
                     for c in channels]  # fmt: skip
            rows = []
            for n in lengths:
                results = {"on": [], "off": []}
                for i in range(2 * args.reps + 2):  # the first two are warm-ups
                    ids = torch.randint(10, CFG["vocab_size"], (n,), generator=g).tolist()
                    on_pair = i % 2  # alternates per prompt, and so does the order
                    for mode in ("on", "off") if (i // 2) % 2 else ("off", "on"):
                        k = on_pair if mode == "on" else 1 - on_pair
                        r = run_one(stubs[k], pairs[k][0], f"{mode}-{n}-{i}", ids, sp, prefetch=mode == "on")
                        if i >= 2:
                            results[mode].append(r)
                rows.append((n, results))
            for chans in channels:
                for c in chans:
                    c.close()
        finally:
            stop_workers(procs)
    kv_mb = CFG["num_hidden_layers"] * 2 * CFG["num_key_value_heads"] * (CFG["hidden_size"] // CFG["num_attention_heads"]) * 4
    print(f"transport {args.transport}, CPU fp32, {2 * args.reps} requests per cell (medians), KV {kv_mb / 1024:.0f} "
          f"KB/token, {'prefill and decode on separate cores' if args.split_cores else 'all processes on all cores'}")
    print(f"{'tokens':>7} {'KV MB':>7} {'1st token off ms':>16} {'1st token on ms':>15} {'ready off ms':>13} "
          f"{'ready on ms':>12} {'on/off':>7} {'import off ms':>14} {'import on ms':>13} {'prefetched':>10}")
    for n, res in rows:
        med = {m: [statistics.median(x) for x in zip(*[r[:3] for r in res[m]], strict=True)] for m in res}
        prefetched = sum(r[3] for r in res["on"])
        print(f"{n:>7} {n * kv_mb / 1e6:>7.0f} {med['off'][0] * 1e3:>16.1f} {med['on'][0] * 1e3:>15.1f} {med['off'][1] * 1e3:>13.1f} "
              f"{med['on'][1] * 1e3:>12.1f} {med['on'][1] / med['off'][1]:>7.3f} {med['off'][2]:>14.1f} "
              f"{med['on'][2]:>13.1f} {prefetched:>7}/{len(res['on'])}")


if __name__ == "__main__":
    main()
