"""What a JSON schema costs a decode step: the same batch with and without `json_schema`, side by side.

Runs the embedded model (or `--model`) on CPU, or the GPU with `--gpu`, a batch of `--batch`
requests (greedy, or sampled with `--temperature`), first free text, then guided by a schema whose output can go on for the whole
budget (an array of at least that many digits), and prints decode tokens/s of each and their ratio, then the
masks' own cost: one row's mask and its token consumed, and a whole batch's masks at once (llguidance's
executor, then unpacked on the device: `engine/guided.py::StepMasks`).
With async scheduling (on by default on a GPU) a batch of guided rows that want only their tokens still runs
ahead (`ModelRunner.settle_guided`); the third column is the same guided batch kept from running ahead, as every
guided step was before, measured in the same round.

    python benchmarks/guided.py [--batch 8] [--new-tokens 64] [--gpu] [--temperature 1.0]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def schema(new_tokens: int) -> dict:
    """An array of at least `new_tokens` one-digit integers: the output runs to the token budget."""
    items = {"type": "integer", "minimum": 0, "maximum": 9}
    return {"type": "object", "properties": {"values": {"type": "array", "items": items, "minItems": new_tokens}},
            "required": ["values"]}  # fmt: skip


def _decode_tok_s(llm, prompts, params) -> tuple[float, int]:
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(r.generated_tokens) for r in results)
    return tokens / seconds, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory with tokenizer.json (default: the embedded model)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="free / guided pairs, alternating")
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; else both forms sampled (seeded)")
    args = p.parse_args()

    from splitserve import LLM, SamplingParams
    from splitserve.engine.guided import StepMasks

    options = dict(block_size_tokens=16, num_blocks=1024)
    if args.gpu:
        options.update(device="cuda", enable_cuda_graphs=True)
    llm = LLM(args.model, **options) if args.model else LLM(**options)
    prompts = [f"Request {i}: list some numbers as JSON." for i in range(args.batch)]
    sampling = dict(temperature=args.temperature, seed=1)
    free = SamplingParams(num_tokens_to_generate=args.new_tokens, ignore_eos=True, **sampling)
    guided = SamplingParams(num_tokens_to_generate=args.new_tokens, json_schema=json.dumps(schema(args.new_tokens)), **sampling)
    llm.generate(prompts, free)  # warm-up: compiles, graphs
    llm.generate(prompts, guided)
    rows = []
    for _ in range(args.rounds):
        f, g = _decode_tok_s(llm, prompts, free), _decode_tok_s(llm, prompts, guided)
        ahead, llm.engine.async_scheduling = llm.engine.async_scheduling, False  # every guided step waits,
        held = _decode_tok_s(llm, prompts, guided)  # as before settle_guided (the batch is all guided rows)
        llm.engine.async_scheduling = ahead
        rows.append((f, g, held))
    print(f"# batch {args.batch}, {args.new_tokens} new tokens, {'cuda' if args.gpu else 'cpu'}, temperature {args.temperature}, "
          f"async scheduling {'on' if llm.engine.async_scheduling else 'off'}")
    print(f"{'round':>5} {'free tok/s':>11} {'guided tok/s':>13} {'not ahead':>10} {'guided tokens':>14} {'ratio':>6} "
          f"{'not ahead':>10}")
    for i, ((f, _), (g, n), (h, _)) in enumerate(rows):
        print(f"{i:>5} {f:>11.1f} {g:>13.1f} {h:>10.1f} {n:>14} {g / f:>6.2f} {h / f:>10.2f}")

    matcher = llm.engine.guides.matcher(guided, [])
    vocab = llm.engine.model_config.vocab_size
    text = llm.engine.tokenizer.encode('{"values": [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2', add_bos=False)
    device = llm.engine.runner.device
    start = time.perf_counter()
    for token in text:
        StepMasks({0: matcher}, vocab).rows(device)
        matcher.consume_token(token)
    per_token = (time.perf_counter() - start) / len(text)
    print(f"one row: mask + consume per token: {per_token * 1e6:.0f} µs (vocabulary {vocab:,})")
    start = time.perf_counter()
    for _ in range(20):
        llm.engine.guides.matcher(guided, [])
    print(f"a new request's matcher: {(time.perf_counter() - start) / 20 * 1e6:.0f} µs")
    matchers = {i: llm.engine.guides.matcher(guided, text[: i % len(text)]) for i in range(args.batch)}
    StepMasks(matchers, vocab).rows(device)
    start = time.perf_counter()
    for _ in range(20):
        StepMasks(matchers, vocab).rows(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"a batch of {args.batch}: masks per step {(time.perf_counter() - start) / 20 * 1e6:.0f} µs")


if __name__ == "__main__":
    main()
