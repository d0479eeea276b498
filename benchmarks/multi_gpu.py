"""Disaggregation across GPUs of one host: TP/PP-mismatched pairs over NCCL and NIXL.

For each pair "PTPxPPP:DTPxDPP" (prefill tp x pp : decode tp x pp) and transport, the
prefill worker gets the first P = PTP*PPP GPUs and the decode worker the next D, each
through CUDA_VISIBLE_DEVICES (real `splitserve prefill-worker|decode-worker` processes,
real gRPC), and the script reports:

1. tokens: 4 prompts, 32 greedy tokens, disaggregated vs the decode worker computing the
   whole request itself (aggregated, same precision) — identical or not, on the embedded
   trained model in bf16 (peaked logits: a TP-layout rounding change does not flip ties);
2. handoff GB/s of an 8k-token prompt's KV on the Llama-3.2-1B shape (the decode worker's
   own transfer timing) ÷ NCCL point-to-point GB/s between the same two GPUs, measured in
   the same run (`--gpus 1` compares with a device copy instead);
3. TTFT disaggregated ÷ aggregated − 1 at 8k tokens (as benchmarks/ttft_disagg.py).

    python3 benchmarks/device_env.py && export PYTHONPATH=/tmp/site
    python3 benchmarks/multi_gpu.py                                   # every pair the GPUs allow
    python3 benchmarks/multi_gpu.py --gpus 1 --pairs 1x1:1x1 --transports nixl,cuda_ipc   # dry run, one GPU

Not here yet: the goodput comparison (1 prefill + 1 decode GPU vs 2 aggregated GPUs on
../shared/data/traces/mooncake_synthetic_trace.jsonl) — it needs the router and etcd
(`splitserve up`), which the lent GPU hosts lack unless an etcd binary is carried.
NCCL cannot join two ranks on one GPU, so torch_dist needs --gpus >= 2.
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
from ttft_disagg import CFG, start_worker, stop_workers  # noqa: E402

from engine import make_checkpoint  # noqa: E402

DEFAULT_PAIRS = "1x1:1x1,2x1:1x1,1x1:2x1,1x2:1x1,1x1:1x2,2x1:2x1"


def parse_pair(text: str) -> tuple[tuple[int, int], tuple[int, int]]:
    prefill, decode = text.split(":")
    p = tuple(int(x) for x in prefill.split("x"))
    d = tuple(int(x) for x in decode.split("x"))
    return p, d


def nccl_p2p_gbps(nbytes: int, gpus: int) -> float:
    """GB/s of a send from GPU 0 to GPU 1 (two processes, NCCL); a device copy with one GPU."""
    if gpus < 2:
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        dst.copy_(src)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            dst.copy_(src)
        torch.cuda.synchronize()
        return nbytes * 10 / (time.perf_counter() - t0) / 1e9
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result = mp.get_context("spawn").Queue()
        procs = [mp.get_context("spawn").Process(target=_p2p_rank, args=(r, f"file://{tmp}/rdv", nbytes, result))
                 for r in range(2)]
        for p in procs:
            p.start()
        gbps = result.get(timeout=300)
        for p in procs:
            p.join(60)
    return gbps


def _p2p_rank(rank: int, init: str, nbytes: int, result) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=2)
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for i in range(13):
        if i == 3:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        dist.send(buf, 1) if rank == 0 else dist.recv(buf, 0)
    torch.cuda.synchronize()
    if rank == 1:
        result.put(nbytes * 10 / (time.perf_counter() - t0) / 1e9)
    dist.destroy_process_group()


def _request(stubs, rid: str, ids: list[int], sp, disagg: bool):
    """(tokens, TTFT seconds, the decode worker's DecodeTiming) of one request, driven as the router does."""
    from splitserve.proto.v1 import decode_worker_pb2, prefill_worker_pb2

    prefill, decode, prefill_addr = stubs
    t0 = time.perf_counter()
    kw = {}
    ttft = None
    if disagg:
        resp = prefill.Prefill(prefill_worker_pb2.PrefillRequest(request_id=rid, token_ids=ids, sampling_params=sp),
                               timeout=300)
        ttft = time.perf_counter() - t0
        kw = dict(handoff=resp.handoff, prefill_address=prefill_addr)
    toks, timing = [], None
    for chunk in decode.Decode(decode_worker_pb2.DecodeRequest(request_id=rid, token_ids=ids, sampling_params=sp, **kw),
                               timeout=300):
        if ttft is None and chunk.token_ids:
            ttft = time.perf_counter() - t0
        toks += chunk.token_ids
        if chunk.HasField("timing"):
            timing = chunk.timing
    return toks, ttft, timing


def run_pair(model: str, big: str, pair, transport: str, gpus: int, tokens: int, reps: int) -> dict:
    import grpc

    from splitserve.engine.sampling_params import SamplingParams
    from splitserve.engine.wire import sampling_to_proto
    from splitserve.proto.v1 import decode_worker_pb2_grpc, prefill_worker_pb2_grpc

    (ptp, ppp), (dtp, dpp) = pair
    p_n, d_n = ptp * ppp, dtp * dpp
    same_gpu = gpus == 1
    p_gpus = "0" if same_gpu else ",".join(str(i) for i in range(p_n))
    d_gpus = "0" if same_gpu else ",".join(str(i) for i in range(p_n, p_n + d_n))
    out = {}
    for name, path in (("tokens", model), ("speed", big)):
        common = ["--device", "cuda", "--dtype", "bfloat16", "--transport", transport, "--block-size", "16",
                  "--buffer-size-gb", "8", "--max-tokens", str(max(8192, tokens)), "--max-requests", "8"]
        prefill_proc, prefill_addr = start_worker("prefill-worker", path, [*common, "--tp", str(ptp), "--pp", str(ppp)], p_gpus)
        decode_proc, decode_addr = start_worker("decode-worker", path, [*common, "--tp", str(dtp), "--pp", str(dpp)], d_gpus)
        try:
            with grpc.insecure_channel(prefill_addr) as pc, grpc.insecure_channel(decode_addr) as dc:
                prefill = prefill_worker_pb2_grpc.PrefillWorkerStub(pc)
                decode = decode_worker_pb2_grpc.DecodeWorkerStub(dc)

                def run(rid, ids, sp, disagg, stubs=(prefill, decode, prefill_addr)):
                    return _request(stubs, rid, ids, sp, disagg)

                g = torch.Generator().manual_seed(0)
                if name == "tokens":
                    sp = sampling_to_proto(SamplingParams(num_tokens_to_generate=32, temperature=0.0, ignore_eos=True))
                    prompts = [torch.randint(10, 3000, (n,), generator=g).tolist() for n in (17, 300, 700, 1000)]
                    same = 0
                    for i, ids in enumerate(prompts):
                        dis, _, _ = run(f"t{i}", ids, sp, True)
                        agg, _, _ = run(f"a{i}", ids, sp, False)
                        same += dis == agg
                    out["identical"] = f"{same}/{len(prompts)}"
                    continue
                sp = sampling_to_proto(SamplingParams(num_tokens_to_generate=2, temperature=0.0, ignore_eos=True))
                agg_t, dis_t, gbps = [], [], []
                for i in range(reps + 2):  # two warm-ups
                    _, a, _ = run(f"sa{i}", torch.randint(10, 100000, (tokens,), generator=g).tolist(), sp, False)
                    _, d, timing = run(f"sd{i}", torch.randint(10, 100000, (tokens,), generator=g).tolist(), sp, True)
                    if i >= 2:
                        agg_t.append(a)
                        dis_t.append(d)
                        if timing is not None and timing.transfer_seconds > 0:
                            gbps.append(timing.transfer_bytes / timing.transfer_seconds / 1e9)
                out["ttft_agg_ms"] = statistics.median(agg_t) * 1e3
                out["ttft_dis_ms"] = statistics.median(dis_t) * 1e3
                out["handoff_gbps"] = statistics.median(gbps) if gbps else float("nan")
        finally:
            stop_workers((prefill_proc, decode_proc))
    return out


def main() -> None:
    from splitserve.engine.default_model import default_model_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--pairs", default=DEFAULT_PAIRS, help="comma-separated PTPxPPP:DTPxDPP")
    p.add_argument("--transports", default="torch_dist,nixl")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    kv_bytes = args.tokens * 16 * 2 * 8 * 64 * 2
    ref = nccl_p2p_gbps(kv_bytes, args.gpus)
    ref_name = "NCCL p2p" if args.gpus >= 2 else "device copy"
    print(f"{args.gpus} GPU(s); {ref_name} of {kv_bytes / 1e6:.0f} MB: {ref:.1f} GB/s")
    print(f"{'pair':>10} {'transport':>10} {'tokens identical':>17} {'handoff GB/s':>13} {'/ ' + ref_name:>13} "
          f"{'TTFT agg ms':>12} {'disagg ms':>10} {'disagg/agg-1':>13}")
    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(Path(tmp), CFG, torch.bfloat16, "cuda")
        for text in args.pairs.split(","):
            pair = parse_pair(text)
            need = pair[0][0] * pair[0][1] + pair[1][0] * pair[1][1]
            for transport in args.transports.split(","):
                if (args.gpus > 1 and need > args.gpus) or (args.gpus == 1 and (need > 2 or transport == "torch_dist")):
                    print(f"{text:>10} {transport:>10}  skipped: needs {need} GPUs")
                    continue
                r = run_pair(str(default_model_path()), tmp, pair, transport, args.gpus, args.tokens, args.reps)
                ratio = r["handoff_gbps"] / ref
                print(f"{text:>10} {transport:>10} {r['identical']:>17} {r['handoff_gbps']:>13.1f} {ratio:>13.1%} "
                      f"{r['ttft_agg_ms']:>12.2f} {r['ttft_dis_ms']:>10.2f} {r['ttft_dis_ms'] / r['ttft_agg_ms'] - 1:>+13.2%}")


if __name__ == "__main__":
    main()
