"""Generate text offline with one engine (the embedded default model unless --model).

Examples:
  splitserve generate
  splitserve generate --prompt "def fibonacci(n):" --max-tokens 64 --temperature 0.7 --seed 1
  splitserve generate --model ./my-llama --tp 2 --prompt "Hello" --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

DEFAULT_PROMPTS = ["def fibonacci(n):", "class Stack:\n    \"\"\"", "import os\n\n\ndef"]


def add_attention_backend_argument(p: argparse.ArgumentParser) -> None:
    from splitserve.engine.config import ATTENTION_BACKENDS

    p.add_argument(
        "--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
        help="auto (Triton kernels on CUDA, torch on CPU), torch, triton, or flashinfer (CUDA with the flashinfer "
        "package; float16/bfloat16)",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__.split("\n\n", 1)[1]
    p.add_argument("--model", default=None, help="Hugging Face checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--prompt", action="append", default=None, help="prompt text; repeat for a batch (default: demo prompts)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message with the model's chat template")
    p.add_argument("--max-tokens", type=int, default=48, help="new tokens per prompt (default 48)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), higher = more random")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling threshold in (0, 1] (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed, for reproducible output")
    p.add_argument("--stop", action="append", default=[], help="stop word; repeatable")
    p.add_argument("--logprobs", action="store_true", help="include log-probs of generated tokens (with --json)")
    p.add_argument("--json-schema", default=None, metavar="SCHEMA",
                   help="structured output: every prompt's text follows this JSON schema (its JSON text, or "
                        "@FILE); '{\"type\": \"object\"}' = any JSON object")
    p.add_argument("--grammar", default=None, metavar="LARK",
                   help="structured output: an llguidance Lark grammar (text, or @FILE) the text must follow")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel ranks (one process each)")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel stages (one process each)")
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu or cuda")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"], help="weights/KV dtype")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16)")
    add_attention_backend_argument(p)
    p.add_argument("--buffer-size-gb", type=float, default=0.25, help="KV cache budget per rank in GiB (default 0.25)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of text")


def run(args: argparse.Namespace) -> int:
    from splitserve.engine.llm import LLM
    from splitserve.engine.sampling_params import SamplingParams

    try:
        schema, grammar = _text_or_file(args.json_schema, "--json-schema"), _text_or_file(args.grammar, "--grammar")
        params = SamplingParams(
            num_tokens_to_generate=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            stop_words=tuple(args.stop),
            return_log_probs=args.logprobs,
            skip_prompt_log_probs=True,
            json_schema=schema,
            grammar=grammar,
        )
        options = dict(
            device=args.device, dtype=args.dtype, block_size_tokens=args.block_size, buffer_size_gb=args.buffer_size_gb,
            attention_backend=args.attention_backend,
        )
        prompts = args.prompt or DEFAULT_PROMPTS
        start = time.perf_counter()
        if args.tp * args.pp > 1:
            if args.chat:
                raise ValueError("--chat with --tp/--pp is not supported yet; pass the templated text")
            from splitserve.engine.launch import generate_on_ranks

            results = generate_on_ranks(args.model, prompts, params, args.tp, args.pp, **options)
        else:
            llm = LLM(args.model, **options)
            if args.chat:
                prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
            results = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    except (ValueError, FileNotFoundError, TypeError) as exc:
        print(f"splitserve generate: error: {exc}", file=sys.stderr)
        return 2
    for prompt, res in zip(prompts, results, strict=True):
        if args.json:
            out = {
                "prompt": prompt,
                "generated_text": res.generated_text,
                "generated_tokens": res.generated_tokens,
                "prompt_length": res.prompt_length,
                "status": res.status,
                "ttft": res.ttft,
            }
            if args.logprobs:
                out["generated_log_probs"] = res.generated_log_probs
            print(json.dumps(out))
        else:
            print(f"\033[1m{prompt}\033[0m{res.generated_text}\n" if sys.stdout.isatty() else f"{prompt}{res.generated_text}\n")
    if not args.json:
        num_tokens = sum(len(r.generated_tokens) for r in results)
        print(f"[{len(results)} prompts, {num_tokens} tokens in {elapsed:.2f} s]", file=sys.stderr)
    return 0


def _text_or_file(value: str | None, flag: str) -> str | None:
    """`value`, or the text of the file it names after an @. FileNotFoundError names `flag`."""
    if value is None or not value.startswith("@"):
        return value
    try:
        with open(value[1:], encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise FileNotFoundError(f"{flag} {value}: {exc.strerror or exc}") from None
