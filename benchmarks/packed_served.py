"""Served NIXL reshard (prefill tp 1 → decode tp 2) with the prefill side packing the head slices
vs reading them from the pool, side by side in one run: real worker processes, real gRPC.

Two pairs run at once, each a tp=1 prefill worker and a tp=2 decode worker (two rank processes)
over NIXL: "packed" with `--pack-for-tp 2` (what `--pack-for-tp auto` resolves to in a cluster
whose spec has a tp=2 decode group), "pool" with `--pack-for-tp 0`. Both run `--no-layerwise`,
so the decode worker's import (`DecodeTiming.transfer_ms`: the pull of both ranks and the
checksum check) is the whole handoff. Which pair serves a prompt first alternates, so neither
order nor machine drift favours a mode. The model has Llama-3.2-1B's KV shape (16 layers, 8 kv
heads of 64; 64 KB per token in fp32) with small projections; fresh random prompts.

    python benchmarks/packed_served.py                      # 1024 / 4096-token prompts
    python benchmarks/packed_served.py --tokens 8192 --reps 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from layerwise_served import CFG, run_one  # noqa: E402
from ttft_disagg import start_worker, stop_workers  # noqa: E402

from engine import make_checkpoint  # noqa: E402


def main() -> None:
    import grpc

    from splitserve.engine.sampling_params import SamplingParams
    from splitserve.engine.wire import sampling_to_proto
    from splitserve.proto.v1 import decode_worker_pb2_grpc, prefill_worker_pb2_grpc

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1024,4096", help="prompt lengths, comma-separated")
    p.add_argument("--reps", type=int, default=4, help="requests per prompt length and mode (medians reported)")
    args = p.parse_args()
    lengths = [int(x) for x in args.tokens.split(",")]
    longest = max(lengths)
    flags = ["--device", "cpu", "--dtype", "float32", "--transport", "nixl", "--block-size", "16", "--no-layerwise",
             "--num-blocks", str(4 * (longest // 16 + 1) + 64), "--max-tokens", str(longest), "--max-requests", "4"]
    g = torch.Generator().manual_seed(0)
    sp = sampling_to_proto(SamplingParams(num_tokens_to_generate=2, temperature=0.0, ignore_eos=True))
    modes = {"packed": "2", "pool": "0"}
    procs, pairs = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(Path(tmp), CFG, torch.float32, "cpu")
        try:
            for mode, pack in modes.items():
                pp, pa = start_worker("prefill-worker", tmp, [*flags, "--pack-for-tp", pack])
                dp, da = start_worker("decode-worker", tmp, [*flags, "--tp", "2"])
                procs += [pp, dp]
                pairs[mode] = (pa, da)
            channels = {m: (grpc.insecure_channel(a), grpc.insecure_channel(b)) for m, (a, b) in pairs.items()}
            stubs = {m: (prefill_worker_pb2_grpc.PrefillWorkerStub(c[0]), decode_worker_pb2_grpc.DecodeWorkerStub(c[1]))
                     for m, c in channels.items()}  # fmt: skip
            rows = []
            for n in lengths:
                imports, pulls = {m: [] for m in modes}, {m: [] for m in modes}
                for i in range(args.reps + 1):  # the first is a warm-up
                    ids = torch.randint(10, CFG["vocab_size"], (n,), generator=g).tolist()
                    for mode in list(modes)[:: 1 if i % 2 else -1]:
                        _, _, transfer_ms, _, pull_ms = run_one(stubs[mode], pairs[mode][0], f"{mode}-{n}-{i}", ids,
                                                                sp, False)
                        if i:
                            imports[mode].append(transfer_ms)
                            pulls[mode].append(pull_ms)
                rows.append((n, imports, pulls))
            for chans in channels.values():
                for c in chans:
                    c.close()
        finally:
            stop_workers(procs)
    kv_kb = CFG["num_hidden_layers"] * 2 * CFG["num_key_value_heads"] * (CFG["hidden_size"] // CFG["num_attention_heads"]) * 4 / 1024
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  NIXL tp 1 -> 2, CPU fp32, KV {kv_kb:.0f} KB/token, "
          f"{args.reps} requests per cell (medians of the decode worker's import)")
    print("(import: plan, pull, checksums of the decode worker; pull: what its transport measured for the pull)")
    print(f"{'tokens':>7} {'KV MB':>7} {'import pool ms':>15} {'import packed ms':>17} {'packed/pool':>12} "
          f"{'pull pool ms':>13} {'pull packed ms':>15} {'packed/pool':>12}")
    for n, imports, pulls in rows:
        pool, packed = statistics.median(imports["pool"]), statistics.median(imports["packed"])
        pull_pool, pull_packed = statistics.median(pulls["pool"]), statistics.median(pulls["packed"])
        print(f"{n:>7} {n * kv_kb / 1024:>7.0f} {pool:>15.1f} {packed:>17.1f} {packed / pool:>12.3f} "
              f"{pull_pool:>13.1f} {pull_packed:>15.1f} {pull_packed / pull_pool:>12.3f}")


if __name__ == "__main__":
    main()
