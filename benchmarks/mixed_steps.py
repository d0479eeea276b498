"""Aggregated serving with chunked prefill: steps that carry prefill chunks, eager vs from CUDA graphs.

The Llama-3.2-1B shape (random bf16 weights, see `engine.py`). `--requests` prompts of
`--prompt` tokens arrive at once with a step budget of `--budget` tokens, so the run is first
prefill chunks, then chunks beside the decodes of the prompts already done, then decodes only.
Each variant runs twice, interleaved (off, on, off, on); prints the wall time of the whole
`generate`, the time of the steps that carried prefill chunks (the rest are decode-only steps,
graphed in both variants) and their ratio.

    python benchmarks/mixed_steps.py [--budget 256] [--requests 64] [--prompt 512] [--new 64]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine import make_checkpoint  # noqa: E402

CFG = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
           num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072)


def run(path: Path, args, mixed_tokens: int) -> tuple[float, float, int, list[list[int]]]:
    """(wall seconds, seconds in steps with prefill chunks, how many such steps, tokens)."""
    from splitserve import LLM, SamplingParams

    llm = LLM(str(path), device="cuda", block_size_tokens=16, buffer_size_gb=20, max_tokens=args.budget,
              max_requests=args.requests, cuda_graph_mixed_max_tokens=mixed_tokens)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 1000, (args.prompt,), generator=g).tolist() for _ in range(args.requests)]
    params = SamplingParams(num_tokens_to_generate=args.new, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up: kernels compile, graphs capture
    engine = llm.engine
    engine.pool.reset_prefix_cache()
    mixed_s, mixed_steps = 0.0, 0
    step = engine.runner.launch

    def timed_launch(out, feed=None):  # a step with a chunk is collected before the next: time to collect
        nonlocal mixed_s, mixed_steps
        if any(c.num_tokens > 1 for c in out.chunks):
            torch.cuda.synchronize()
            t = time.perf_counter()
            pending = step(out, feed)
            torch.cuda.synchronize()
            mixed_s += time.perf_counter() - t
            mixed_steps += 1
            return pending
        return step(out, feed)

    engine.runner.launch = timed_launch
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    results = llm.generate(prompts, params)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    tokens = [r.generated_tokens for r in results]
    del llm, engine
    torch.cuda.empty_cache()
    return wall, mixed_s, mixed_steps, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=int, default=256, help="tokens per step (the scheduler's max_tokens)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    p.add_argument("--new", type=int, default=64, help="new tokens per request")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/mixed_steps.py needs a CUDA device")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        make_checkpoint(path, CFG, torch.bfloat16, "cuda")
        rows = []
        for mixed in (0, args.budget, 0, args.budget):
            wall, mixed_s, steps, tokens = run(path, args, mixed)
            rows.append((mixed, wall, mixed_s, steps, tokens))
        print(f"{args.requests} requests x {args.prompt}-token prompts, {args.new} new tokens, step budget {args.budget}")
        print("| mixed graphs | wall s | steps with chunks | their ms / step |")
        print("|---|---:|---:|---:|")
        for mixed, wall, mixed_s, steps, _ in rows:
            print(f"| {'on' if mixed else 'off'} | {wall:.3f} | {steps} | {mixed_s / max(steps, 1) * 1e3:.2f} |")
        off = [r for r in rows if not r[0]]
        on = [r for r in rows if r[0]]
        best = lambda rs, i: min(r[i] for r in rs)  # noqa: E731
        print(f"on ÷ off: wall {best(on, 1) / best(off, 1):.3f}, steps with chunks {best(on, 2) / best(off, 2):.3f}")
        same = sum(a == b for a, b in zip(off[0][4], on[0][4], strict=True))
        print(f"greedy tokens identical on {same}/{len(off[0][4])} requests (bf16: a near-tie may flip one)")


if __name__ == "__main__":
    main()
