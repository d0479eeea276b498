"""Engine throughput beside Hugging Face `transformers.generate`, in one run.

CPU (default): a small random Llama; prints prefill and decode tokens/s of both
and their ratios.

GPU (`--gpu`): the Llama-3.2-1B shape (16 layers, hidden 2048, 32 heads, 8 kv
heads, vocab 128,256) with random bf16 weights, batch 1 and 64, 512-token
prompts + 256 new tokens. Prints decode tokens/s ÷ the HBM roofline (weights +
KV bytes per step ÷ a device copy bandwidth measured in the same run) and
prefill MFU (÷ a bf16 matmul peak measured in the same run).

    python benchmarks/engine.py            # CPU
    python benchmarks/engine.py --gpu      # H200
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def make_checkpoint(path: Path, cfg: dict, dtype: torch.dtype, device: str) -> None:
    """Random weights straight into safetensors (no slow module init)."""
    from safetensors.torch import save_file

    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype).cpu()

    tensors = {"model.embed_tokens.weight": rnd(cfg["vocab_size"], h), "model.norm.weight": torch.ones(h, dtype=dtype)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rnd(h, h),
            p + "self_attn.k_proj.weight": rnd(kv, h),
            p + "self_attn.v_proj.weight": rnd(kv, h),
            p + "self_attn.o_proj.weight": rnd(h, h),
            p + "mlp.gate_proj.weight": rnd(inter, h),
            p + "mlp.up_proj.weight": rnd(inter, h),
            p + "mlp.down_proj.weight": rnd(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
        }
    save_file(tensors, str(path / "model.safetensors"))
    config = dict(cfg, architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype=str(dtype).split(".")[1],
                  tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu")
    (path / "config.json").write_text(json.dumps(config))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


WARMUP = "full"
EXTRA: dict = {}


def time_ours(path: Path, batch: int, prompt_len: int, new: int, device: str, **options) -> tuple[float, float]:
    """(prefill seconds for the batch, seconds per decode step), ours."""
    from splitserve import LLM, SamplingParams

    llm = LLM(str(path), device=device, **options)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 1000, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    # Warm up with the timed shapes: kernels compile and CUDA graphs capture per shape.
    warm = SamplingParams(num_tokens_to_generate=4, temperature=0.0, ignore_eos=True)
    llm.generate(prompts if WARMUP == "full" else prompts[:2], warm)
    if WARMUP != "full":  # the batch's prefill shapes warm too: the decode time below is total - prefill,
        # and a prefill timed with its one-off compiles in it made that difference negative
        llm.engine.pool.reset_prefix_cache()
        llm.generate(prompts, SamplingParams(num_tokens_to_generate=1, temperature=0.0, ignore_eos=True))
    llm.engine.pool.reset_prefix_cache()
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(num_tokens_to_generate=1, temperature=0.0, ignore_eos=True))
    sync(device)
    prefill = time.perf_counter() - t0
    llm.engine.pool.reset_prefix_cache()
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(num_tokens_to_generate=new, temperature=0.0, ignore_eos=True))
    sync(device)
    total = time.perf_counter() - t0
    return prefill, (total - prefill) / (new - 1)


def time_hf(path: Path, batch: int, prompt_len: int, new: int, device: str, dtype: torch.dtype) -> tuple[float, float]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(10, 1000, (batch, prompt_len), generator=g).to(device)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate(ids[:2], max_new_tokens=4, **kw)
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, **kw)
    sync(device)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
    sync(device)
    total = time.perf_counter() - t0
    del model
    return prefill, (total - prefill) / (new - 1)


def copy_bandwidth() -> float:
    """Device memory bandwidth in bytes/s: read + write of a 2 GiB copy."""
    src = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 2 * 10 / (time.perf_counter() - t0)


def matmul_peak() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    return 2 * 8192**3 * 20 / (time.perf_counter() - t0)


def run_cpu(args) -> None:
    torch.set_num_threads(args.threads)
    cfg = dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        make_checkpoint(path, cfg, torch.float32, "cpu")
        rows = []
        for batch in (1, 8):
            ours = time_ours(path, batch, 128, 32, "cpu", block_size_tokens=16, buffer_size_gb=0.5, max_tokens=4096)
            hf = time_hf(path, batch, 128, 32, "cpu", torch.float32)
            rows.append((batch, ours, hf))
        print(f"CPU, {args.threads} thread(s), 4-layer hidden-256 Llama, 128-token prompts, 32 new tokens")
        print(f"{'batch':>5} {'prefill tok/s ours':>19} {'HF':>9} {'ratio':>6} {'decode tok/s ours':>18} {'HF':>9} {'ratio':>6}")
        for batch, (op, od), (hp, hd) in rows:
            print(f"{batch:>5} {batch * 128 / op:>19.0f} {batch * 128 / hp:>9.0f} {hp / op:>6.2f} "
                  f"{batch / od:>18.0f} {batch / hd:>9.0f} {hd / od:>6.2f}")


def check_gpu_backends() -> None:
    """Greedy tokens of torch vs triton (+ CUDA graphs) backends vs transformers, fp32, on CUDA."""
    import transformers

    from splitserve import LLM, SamplingParams

    cfg = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        make_checkpoint(path, cfg, torch.float32, "cuda")
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (1, 17, 100, 300)]
        params = SamplingParams(num_tokens_to_generate=32, temperature=0.0, ignore_eos=True)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
        ref = [hf.generate(torch.tensor([p]).cuda(), max_new_tokens=32, do_sample=False, eos_token_id=None)[0, len(p):].tolist()
               for p in prompts]
        for backend, graphs in (("torch", False), ("triton", False), ("triton", True)):
            llm = LLM(str(path), device="cuda", attention_backend=backend, enable_cuda_graphs=graphs,
                      block_size_tokens=16, num_blocks=512, max_tokens=256)
            got = [r.generated_tokens for r in llm.generate(prompts, params)]
            llm.engine.check_integrity()
            same = sum(a == b for a, b in zip(got, ref, strict=False))
            print(f"check cuda fp32 backend={backend} graphs={graphs}: {same}/{len(ref)} prompts identical to HF")


def check_bf16_agreement(path: str, label: str, prompts: list[list[int]], new: int = 256) -> None:
    """Top-1 agreement with transformers in bf16: at every position we generated greedily,
    is our token HF's argmax too? HF is teacher-forced on our sequence (one forward), so one
    early near-tie does not decide every later position."""
    import transformers

    from splitserve import LLM, SamplingParams

    llm = LLM(path, device="cuda", dtype="bfloat16", block_size_tokens=16, num_blocks=2048, max_tokens=4096, **EXTRA)
    params = SamplingParams(num_tokens_to_generate=new, temperature=0.0, ignore_eos=True)
    ours = [r.generated_tokens for r in llm.generate(prompts, params)]
    del llm
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    agree = total = 0
    for prompt, tokens in zip(prompts, ours, strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens], device="cuda")).logits[0, len(prompt) - 1 : -1]
        agree += int((logits.argmax(-1).cpu() == torch.tensor(tokens)).sum())
        total += len(tokens)
    del hf
    torch.cuda.empty_cache()
    print(f"check cuda bf16 {label}: top-1 agreement with transformers {agree / total:.2%} over {total} tokens")


def check_bf16(path: Path) -> None:
    from splitserve.engine.default_model import default_model_path
    from splitserve.engine.tokenizer import Tokenizer

    model = str(default_model_path())
    tok = Tokenizer(model)
    texts = ["def fibonacci(n):", "import os\nimport sys\n\n\nclass ", "    for key, value in ", "# Copyright"]
    check_bf16_agreement(model, "default model", [tok.encode(t) for t in texts])
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 30000, (n,), generator=g).tolist() for n in (16, 200, 500)]
    check_bf16_agreement(str(path), "1B shape, random weights", prompts)


def run_gpu(args) -> None:
    if not args.skip_check:
        check_gpu_backends()
    cfg = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072)
    bw, peak = copy_bandwidth(), matmul_peak()
    params = 128256 * 2048 + 16 * (2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 2048 * 8192)
    weight_bytes = 2 * params
    kv_per_token = 16 * 2 * 8 * 64 * 2
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul peak {peak / 1e12:.0f} TFLOP/s, params {params / 1e9:.2f} B")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        make_checkpoint(path, cfg, torch.bfloat16, "cuda")
        if not args.skip_check:
            check_bf16(path)
        out = []
        for batch in [int(b) for b in args.batches.split(",")]:
            ours = time_ours(path, batch, 512, args.new_tokens, "cuda", block_size_tokens=16, buffer_size_gb=20,
                             max_tokens=max(8192, batch * 512), max_requests=128, **EXTRA)
            hf = time_hf(path, batch, 512, args.new_tokens, "cuda", torch.bfloat16) if not args.skip_hf else (float("nan"),) * 2
            avg_ctx = 512 + args.new_tokens / 2
            step_bytes = weight_bytes + batch * avg_ctx * kv_per_token
            roofline = batch / (step_bytes / bw)
            flops = 2 * params * batch * 512 + 4 * 16 * 2048 * batch * 512 * 512 / 2
            out.append((batch, ours, hf, roofline, flops))
        print(f"{'batch':>5} {'decode tok/s ours':>18} {'HF':>8} {'ours/HF':>8} {'roofline':>9} {'ours/roof':>10} {'HF/roof':>8} {'prefill MFU ours':>17} {'HF':>6}")
        for batch, (op, od), (hp, hd), roof, flops in out:
            print(f"{batch:>5} {batch / od:>18.0f} {batch / hd:>8.0f} {hd / od:>8.2f} {roof:>9.0f} {batch / od / roof:>10.1%} "
                  f"{batch / hd / roof:>8.1%} {flops / op / peak:>17.1%} {flops / hp / peak:>6.1%}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help="run the H200 variant")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (CPU variant)")
    p.add_argument("--new-tokens", type=int, default=256, help="new tokens per request (GPU variant)")
    p.add_argument("--skip-hf", action="store_true", help="GPU: skip the transformers baseline")
    p.add_argument("--skip-check", action="store_true", help="GPU: skip the backend correctness check")
    p.add_argument("--warmup", default="full", choices=["full", "small"], help="warm up with the timed batch, or decode with 2 prompts (the batch's prefill still warmed)")
    p.add_argument("--batches", default="1,64", help="GPU: batch sizes")
    p.add_argument("--option", action="append", default=[], help="GPU: engine option KEY=VALUE (repeatable)")
    args = p.parse_args()
    global WARMUP
    WARMUP = args.warmup
    for item in args.option:
        key, value = item.split("=", 1)
        EXTRA[key] = {"true": True, "false": False}.get(value, value)
    run_gpu(args) if args.gpu else run_cpu(args)


if __name__ == "__main__":
    main()
