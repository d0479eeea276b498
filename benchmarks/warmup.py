"""What the first requests at each batch size cost a fresh engine, with and without the warm-up
(engine/warmup.py), side by side in one run.

Each case runs in a fresh process with an empty Triton cache (TRITON_CACHE_DIR in a new temp
directory: as on a host that never ran these kernels) and times, at batch sizes 1, 8 and 64 in
turn, the first `generate` of that many prompts and then the same again: first ÷ again is what
the first clients pay over a warm engine.

    python benchmarks/warmup.py            # CPU: the embedded model
    python benchmarks/warmup.py --gpu      # the Llama-3.2-1B shape, random bf16 weights (H200)
    python benchmarks/warmup.py --gpu --why   # also: what each first generate compiled and captured
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BATCHES = (1, 8, 64)


def record_first_uses(events: list) -> None:
    """Append (what, name, seconds) to `events` for every Triton compile and every CUDA graph
    capture (decode, mixed-step and sampler graphs) from now on."""
    import triton.runtime.jit as jit

    from splitserve.engine import cuda_graphs, mixed_graphs, sampler_graphs

    def timed(owner, attr, what, name_of):
        original = getattr(owner, attr)

        def wrapper(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                events.append((what, name_of(self, args), time.perf_counter() - t0))

        setattr(owner, attr, wrapper)

    def compiled(self, args) -> str:  # (key, signature, device, constexprs, options, attrs, ...): the specialization
        try:
            names = self.arg_names
            attrs = {".".join(names[i] for i in k) if isinstance(k, tuple) else k: v for k, v in args[5].items()}
        except Exception:  # noqa: BLE001 - another Triton's layout: the name alone
            attrs = ""
        return f"{self.fn.__name__} {attrs}"

    timed(jit.JITFunction, "_do_compile", "compile", compiled)
    for owner, what in ((cuda_graphs.DecodeGraphs, "decode graph"), (mixed_graphs.MixedGraphs, "mixed graph"),
                        (sampler_graphs.SamplerGraphs, "sampler graph")):
        timed(owner, "_capture", what, lambda self, args: str(tuple(args)))


def child(warm: bool, gpu: bool, model: str | None, why: bool = False) -> dict:
    import torch

    from splitserve import LLM, SamplingParams
    from splitserve.engine.warmup import warm_up

    if not gpu:
        torch.set_num_threads(1)
    started = time.perf_counter()
    llm = LLM(model, device="cuda" if gpu else "cpu", **({"dtype": "bfloat16"} if gpu else {}))
    out = {"build_s": time.perf_counter() - started, "warm_up_s": None}
    events: list = []
    if why:
        record_first_uses(events)
    if warm:
        report = warm_up(llm.engine)
        out["warm_up_s"], out["warm_up_batches"] = report.seconds, report.batches
    params = SamplingParams(num_tokens_to_generate=8, temperature=0.0, ignore_eos=True)
    vocab = llm.engine.model_config.vocab_size
    for batch in BATCHES:
        times = []
        for again in range(2):
            prompts = [[(97 * i + 31 * j + again + 5) % vocab for j in range(40)] for i in range(batch)]
            del events[:]
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            times.append(time.perf_counter() - t0)
            if again == 0 and why:
                out[f"why{batch}"] = [(what, name, round(1e3 * s, 1)) for what, name, s in events]
        out[f"b{batch}"] = times
    return out


def run_case(warm: bool, gpu: bool, model: str | None, why: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="splitserve-triton-") as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        args = [sys.executable, __file__, "--child", "warm" if warm else "cold"] + (["--gpu"] if gpu else [])
        args += (["--model", model] if model else []) + (["--why"] if why else [])
        done = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--model", default=None, help="checkpoint directory (default: embedded model; --gpu: 1B shape)")
    p.add_argument("--why", action="store_true", help="list the kernels compiled and graphs captured by each first generate")
    p.add_argument("--child", choices=["cold", "warm"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child == "warm", args.gpu, args.model, args.why)))
        return
    model = args.model
    with tempfile.TemporaryDirectory() as tmp:
        if args.gpu and model is None:
            import torch

            sys.path.insert(0, str(Path(__file__).parent))
            from decode_profile import CFG  # the Llama-3.2-1B shape

            from engine import make_checkpoint  # benchmarks/engine.py

            make_checkpoint(Path(tmp), CFG, torch.bfloat16, "cuda")
            model = tmp
        cases = {name: run_case(name == "warm", args.gpu, model, args.why) for name in ("cold", "warm")}
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  {'GPU' if args.gpu else 'CPU'}; fresh process and Triton cache each; "
          f"40-token prompts, 8 new tokens")
    for name, case in cases.items():
        extra = "" if case["warm_up_s"] is None else f", warm-up {case['warm_up_s']:.2f} s at {case['warm_up_batches']}"
        print(f"{name}: engine built in {case['build_s']:.2f} s{extra}")
    print(f"{'batch':>5} {'cold first ms':>14} {'cold again ms':>14} {'first/again':>11} {'warm first ms':>14} "
          f"{'warm again ms':>14} {'first/again':>11}")
    for batch in BATCHES:
        (cf, ca), (wf, wa) = cases["cold"][f"b{batch}"], cases["warm"][f"b{batch}"]
        print(f"{batch:>5} {1e3 * cf:>14.1f} {1e3 * ca:>14.1f} {cf / ca:>10.2f}x {1e3 * wf:>14.1f} {1e3 * wa:>14.1f} "
              f"{wf / wa:>10.2f}x")

    for batch in BATCHES if args.why else ():
        for what, name, ms in cases["warm"][f"why{batch}"]:
            print(f"warm engine, first batch {batch}: {what} {name} {ms} ms")


if __name__ == "__main__":
    main()
