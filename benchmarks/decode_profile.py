"""Where a decode step's time goes on the GPU: host work vs the graph replay.

Runs our engine on the Llama-3.2-1B shape (random bf16 weights, see
`engine.py`) and reports, per batch size:

- the step time seen by `LLM.generate` (prefill excluded),
- the time of the CUDA-graph replay alone for the same bucket (the GPU-bound floor),
- with `--profile`, the top functions by own time under cProfile (host hot spots),
- with `--replay-kernels`, the GPU time of each kernel inside 20 replays of the decode graph
  (CUPTI records the kernels a graph launches; unlike `--kernels`, which profiles eager steps,
  this shows them as they run back to back under programmatic dependent launch, where a
  kernel's own speed and its speed in the step have differed: benchmarks/RESULTS.md, session 20;
  under PDL the spans overlap, see the note printed with the table).

- with `--adjusted N`, N requests of each batch carry a frequency penalty and a logit bias
  (adjusted on the device at launch: engine/adjusted_rows.py): the step time it costs every
  request beside them.
- with `--logprobs N`, N requests of each batch want their tokens' log-probs and the top 5
  (computed on the device at launch: engine/step_logprobs.py), likewise.

    python benchmarks/decode_profile.py --batches 1,64 [--profile] [--replay-kernels] [--option KEY=VALUE]
    python benchmarks/decode_profile.py --batches 64 --adjusted 0,1    # the cost of one penalized request
    python benchmarks/decode_profile.py --batches 64 --logprobs 0,1,64 # ... of requests that want log-probs
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine import copy_bandwidth, make_checkpoint  # noqa: E402

CFG = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
           num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072)


def _decode_graph(llm, batch: int):
    """The captured decode graph a batch of `batch` ran on (None: graphs off)."""
    graphs = llm.engine.runner.graphs
    if graphs is None:
        return None
    bucket = next(b for b in graphs.buckets if b >= batch)
    width = min(w for b, w in graphs._static if b == bucket)  # the context bucket the run used
    return graphs._get(bucket, width).graph


def replay_time(llm, batch: int, iters: int = 50) -> float:
    graph = _decode_graph(llm, batch)
    if graph is None:
        return float("nan")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def _table(prof) -> str:
    """The profiler's per-kernel table, with a warning where the spans overlap."""
    from splitserve.kernels._pdl import pdl_mode

    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
    if pdl_mode(torch.device("cuda")):  # measured on the H200, session 22: spans summed to ~2x the replay
        table += ("\nprogrammatic dependent launch is on: a kernel's span starts when its grid launches early and "
                  "includes its wait for the previous kernel, so spans overlap and do not add up to the step; "
                  "SPLITSERVE_PDL=0 gives separable times (of a step without PDL, on cuBLAS projections)\n")
    return table


def replay_kernel_table(llm, batch: int, iters: int = 20) -> str:
    """Per-kernel GPU time inside `iters` replays of the decode graph `replay_time` replays."""
    from torch.profiler import ProfilerActivity, profile

    graph = _decode_graph(llm, batch)
    if graph is None:
        return "(CUDA graphs off: nothing replayed)"
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            graph.replay()
        torch.cuda.synchronize()
    return _table(prof) + "\n" + critical_path_table(prof, iters)


def critical_path_table(prof, iters: int) -> str:
    """What each kernel adds to the timeline: kernels in start order, each credited with how far
    its end moves the latest end so far (a kernel that ends inside an earlier one's span, or a
    span's early-launch wait under PDL, adds nothing), plus the gaps where no kernel ran. The
    credits sum to the replays' GPU span, so unlike the spans they add up to the step."""
    from collections import defaultdict

    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    if not kernels:
        return "(no kernels recorded)"
    credit: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    span: dict[str, float] = defaultdict(float)
    frontier, idle = kernels[0][0], 0.0
    for start, end, name in kernels:
        if start > frontier:
            idle += start - frontier
        credit[name] += max(0.0, end - max(start, frontier))
        frontier = max(frontier, end)
        calls[name] += 1
        span[name] += end - start
    total = frontier - kernels[0][0]
    lines = [f"critical path per replay (µs; {iters} replays, {total / iters:.1f} µs of GPU timeline each):",
             f"{'kernel':60} {'calls':>6} {'span/call':>10} {'adds':>8} {'share':>7}"]
    for name in sorted(credit, key=credit.get, reverse=True)[:16]:
        lines.append(f"{name[:60]:60} {calls[name] / iters:6.0f} {span[name] / calls[name]:10.2f} "
                     f"{credit[name] / iters:8.1f} {credit[name] / total:7.1%}")
    lines.append(f"{'(no kernel running)':60} {'':6} {'':10} {idle / iters:8.1f} {idle / total:7.1%}")
    return "\n".join(lines)


def kernel_table(path: Path, batch: int, extra: dict, steps: int = 20) -> str:
    """Per-kernel GPU time of eager decode steps (graphs off, so every kernel is
    visible to the profiler; the kernels are the ones the graph replays)."""
    from torch.profiler import ProfilerActivity, profile

    from splitserve import LLM, SamplingParams

    llm = LLM(str(path), device="cuda", block_size_tokens=16, buffer_size_gb=20, max_tokens=32768,
              max_requests=128, **dict(extra, enable_cuda_graphs=False))
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(num_tokens_to_generate=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        llm.engine.add_request(f"r{i}", torch.randint(10, 1000, (512,), generator=g).tolist(), params)
    for _ in range(4):
        llm.engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.engine.step()
        torch.cuda.synchronize()
    return _table(prof)


def generate(llm, prompts, params, adjusted: int, logprobs: int = 0):
    """`llm.generate(prompts, params)`, the first `adjusted` requests with a frequency penalty and a
    logit bias added, the last `logprobs` wanting log-probs and the top 5 (engine requests: one
    SamplingParams per request)."""
    if not adjusted and not logprobs:
        return llm.generate(prompts, params)
    from dataclasses import replace

    engine, done = llm.engine, {}
    for i, prompt in enumerate(prompts):
        extra = dict(frequency_penalty=0.5, logit_bias={13: 0.5}) if i < adjusted else {}
        if i >= len(prompts) - logprobs:
            extra.update(return_log_probs=True, skip_prompt_log_probs=True, top_n_logprobs=5)
        engine.add_request(f"adj{i}", prompt, replace(params, **extra))
    snapshot, engine.snapshot_outputs = engine.snapshot_outputs, False  # as `LLM.generate` runs it
    try:
        while engine.has_unfinished():
            for out in engine.step():
                if out.result is not None and out.result.is_finished:
                    done[out.request_id] = out.result
    finally:
        engine.snapshot_outputs = snapshot
    return [done[f"adj{i}"] for i in range(len(prompts))]


def main() -> None:
    from splitserve import LLM, SamplingParams

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--profile", action="store_true", help="cProfile the decode run and print hot spots")
    p.add_argument("--sample", default=None, metavar="T,K,P",
                   help="sample with temperature T, top-k K, top-p P (seeded) instead of greedy")
    p.add_argument("--kernels", action="store_true", help="print per-kernel GPU time of 20 eager decode steps")
    p.add_argument("--replay-kernels", action="store_true", help="print per-kernel GPU time inside 20 graph replays")
    p.add_argument("--option", action="append", default=[], help="engine option KEY=VALUE (repeatable)")
    p.add_argument("--adjusted", default="0", metavar="N[,N...]",
                   help="requests per batch with a frequency penalty and a logit bias (one row per value)")
    p.add_argument("--logprobs", default="0", metavar="N[,N...]",
                   help="requests per batch that want log-probs and the top 5 (one row per value)")
    args = p.parse_args()
    extra = {}
    for item in args.option:
        key, value = item.split("=", 1)
        extra[key] = {"true": True, "false": False}.get(value, value)
    bw = copy_bandwidth()
    params = 128256 * 2048 + 16 * (2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 2048 * 8192)
    kv_per_token = 16 * 2 * 8 * 64 * 2
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        make_checkpoint(path, CFG, torch.bfloat16, "cuda")
        if args.kernels:
            for batch in [int(b) for b in args.batches.split(",")]:
                print(f"--- kernels, batch {batch}, 20 decode steps ---")
                print(kernel_table(path, batch, extra))
            return
        llm = LLM(str(path), device="cuda", block_size_tokens=16, buffer_size_gb=20, max_tokens=32768,
                  max_requests=128, **extra)
        rows = []
        cases = [(int(b), int(a), min(int(n), int(b))) for b in args.batches.split(",")
                 for a in args.adjusted.split(",") for n in args.logprobs.split(",")]
        for batch, adjusted, logprobs in cases:
            g = torch.Generator().manual_seed(1)
            prompts = [torch.randint(10, 1000, (512,), generator=g).tolist() for _ in range(batch)]
            how = dict(temperature=0.0)
            if args.sample:
                t, k, top_p = args.sample.split(",")
                how = dict(temperature=float(t), top_k=int(k), top_p=float(top_p), seed=7)
            generate(llm, prompts, SamplingParams(num_tokens_to_generate=4, ignore_eos=True, **how), adjusted, logprobs)
            timings = []
            for new in (1, args.new_tokens):
                llm.engine.pool.reset_prefix_cache()
                prof = cProfile.Profile() if args.profile and new > 1 else None
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if prof:
                    prof.enable()
                res = generate(llm, prompts, SamplingParams(num_tokens_to_generate=new, ignore_eos=True, **how), adjusted,
                               logprobs)
                torch.cuda.synchronize()
                if prof:
                    prof.disable()
                timings.append(time.perf_counter() - t0)
            step = (timings[1] - timings[0]) / (args.new_tokens - 1)
            if args.sample:  # the same seed draws the same tokens again
                llm.engine.pool.reset_prefix_cache()
                again = llm.generate(prompts, SamplingParams(num_tokens_to_generate=args.new_tokens, ignore_eos=True, **how))
                same = sum(a.generated_tokens == b.generated_tokens for a, b in zip(res, again, strict=True))
                print(f"batch {batch}: sampled twice with one seed: {same}/{batch} requests identical")
            replay = replay_time(llm, batch)
            step_bytes = 2 * params + batch * (512 + args.new_tokens / 2) * kv_per_token
            roof_step = step_bytes / bw
            rows.append((batch, adjusted, logprobs, step, replay, roof_step))
            if prof:
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
                print(f"--- cProfile, batch {batch} (profiled run; overhead inflates times) ---")
                print(s.getvalue()[:6000])
        # after every timed row: a batch timed after the profiler ran showed a step shorter than its
        # replay (batch 1 after batch 64 on an H100, session 32)
        for batch in dict.fromkeys(r[0] for r in rows) if args.replay_kernels else ():
            print(f"--- kernels inside 20 replays of the batch-{batch} decode graph ---")
            print(replay_kernel_table(llm, batch))
        print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
        print(f"{'batch':>5} {'adjusted':>8} {'logprobs':>8} {'step ms':>8} {'replay ms':>10} {'roofline ms':>12} "
              f"{'step/roof':>10} {'replay/roof':>12}")
        for batch, adjusted, logprobs, step, replay, roof in rows:
            print(f"{batch:>5} {adjusted:>8} {logprobs:>8} {step * 1e3:>8.3f} {replay * 1e3:>10.3f} {roof * 1e3:>12.3f} "
                  f"{roof / step:>10.1%} {roof / replay:>12.1%}")


if __name__ == "__main__":
    main()
