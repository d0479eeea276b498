"""Triton kernels beside their torch counterparts on one GPU, in one run.

Llama-3.2-1B attention shape (32 q heads, 8 kv heads, head_dim 64, block 16),
bf16. Each case first checks the kernel against its fp32 torch reference
(kernels/reference.py), then times, with CUDA-graph replay:

    ours        the Triton kernel
    torch       the engine's torch path today (engine/attention.py: gather the
                blocks, then scaled_dot_product_attention / index_put)
    sdpa        (attention only) SDPA over K/V already contiguous: no paging cost
    flashinfer  (attention only, when the flashinfer package is installed) FlashInfer's paged
                decode / prefill wrappers on the same KV (engine/attention_flashinfer.py);
                decode with (`fi tc`) and without (`fi`) its tensor-core kernels; "-" if absent

Each layer's call reads its own KV copy, with enough copies to exceed the L2
several times, so small cases are measured from HBM as in a real model. GB/s
counts K/V bytes read (write_kv: bytes read + written); `% copy` divides by a
device-to-device copy measured in the same run. Prefill also prints TFLOP/s.

    python benchmarks/kernels.py               # all cases (< 2 min on an H200)
    python benchmarks/kernels.py --only decode

A failing case prints its error and the run goes on.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import random
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
HQ, HKV, HEAD_DIM, BLOCK = 32, 8, 64, 16
DTYPE = torch.bfloat16
SCALE = HEAD_DIM**-0.5
L2_FLUSH_BYTES = 256 << 20  # KV copies per case add up to at least this much
MAX_LAYERS = 128


def load_kernels():
    """splitserve.kernels when the project is installed, else ./kernels loaded by path
    (this file is itself named kernels.py, so a plain `import kernels` would find it)."""
    try:
        return importlib.import_module("splitserve.kernels")
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "_splitserve_kernels",
            ROOT / "kernels" / "__init__.py",
            submodule_search_locations=[str(ROOT / "kernels")],
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module


PKG = load_kernels()
decode_mod = importlib.import_module(PKG.__name__ + ".paged_decode")
prefill_mod = importlib.import_module(PKG.__name__ + ".paged_prefill")
write_mod = importlib.import_module(PKG.__name__ + ".kv_write")
reference = importlib.import_module(PKG.__name__ + ".reference")


# --------------------------------------------------------------------------- timing


def time_calls(calls: list[Callable[[], object]], reps: int = 5) -> tuple[float, str]:
    """Seconds per call, replaying one CUDA graph of all calls; eager if capture fails."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in calls:
                c()
        graph.replay()
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        mode = "graph"
    except Exception as e:  # noqa: BLE001 - report and measure eagerly instead
        print(f"    (graph capture failed: {type(e).__name__}: {str(e)[:120]}; timing eagerly)")
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            for c in calls:
                c()
        end.record()
        mode = "eager"
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (reps * len(calls)), mode


def eager_latency(call: Callable[[], object], reps: int = 20) -> float:
    """Wall time per call without graphs (host launch overhead included)."""
    call()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB, bytes read + written per second, measured as
    benchmarks/engine.py does (eager copies; a copy inside a CUDA graph runs slower)."""
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(20):  # let the clocks rise
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * src.element_size() * 10 / (start.elapsed_time(end) / 1e3)


# --------------------------------------------------------------------------- flashinfer


def flashinfer_planner(tensor_cores: bool = True):
    """engine/attention_flashinfer.py's planner, or None where FlashInfer is not installed."""
    try:
        from splitserve.engine import attention_flashinfer as fi
    except ImportError:
        return None
    if not fi.available():
        return None
    shape = fi.Shape(HQ, HKV, HEAD_DIM, BLOCK, DTYPE, SCALE, tensor_cores)
    return fi.FlashInferPlanner(torch.device("cuda"), shape)


def time_flashinfer(q, layers, ctx_lens_list, q_starts, decode_only, expected, tensor_cores=True) -> str:
    """"µs (check)" of FlashInfer over the case's layers (one plan, as in an engine step), or "-"."""
    try:
        planner = flashinfer_planner(tensor_cores)
        if planner is None:
            return "-"
        table = layers[0][1].cpu().tolist()
        planned = planner.plan(table, ctx_lens_list, q_starts, decode_only)
        got = planned.run(q, layers[0][0])
        status = check("flashinfer", got, expected).split(" ")[0]
        outs = [torch.empty_like(q) for _ in layers]
        t, _ = time_calls([(lambda kv=kv, o=o: planned.run(q, kv, out=o)) for (kv, _), o in zip(layers, outs, strict=True)])
        return f"{t * 1e6:.1f} ({status})"
    except Exception as e:  # noqa: BLE001 - FlashInfer's JIT can fail; report it in the cell
        print(f"    (flashinfer failed: {type(e).__name__}: {str(e)[:300]})")
        return "error"


# --------------------------------------------------------------------------- cases


def paged_layers(ctx_lens: list[int], bytes_per_layer: int, seed: int):
    """As many (kv, block_tables) layers as the L2 flush needs; shuffled block ids."""
    num_layers = max(1, min(MAX_LAYERS, math.ceil(L2_FLUSH_BYTES / max(bytes_per_layer, 1))))
    needed = [math.ceil(n / BLOCK) for n in ctx_lens]
    num_blocks, max_blocks = sum(needed), max(needed)
    layers = []
    g = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(num_layers):
        kv = torch.randn(2, num_blocks, HKV, BLOCK, HEAD_DIM, device="cuda", dtype=DTYPE, generator=g)
        ids = list(range(num_blocks))
        random.Random(seed).shuffle(ids)
        table = torch.zeros(len(ctx_lens), max_blocks, dtype=torch.int32)
        used = 0
        for s, n in enumerate(needed):
            table[s, :n] = torch.tensor(ids[used : used + n])
            used += n
        layers.append((kv, table.cuda()))
    return layers


def torch_decode(q, kv, table, ctx_lens):
    """engine/attention.py's decode path."""
    keys = reference.gather_kv(kv[0], table)
    values = reference.gather_kv(kv[1], table)
    mask = torch.arange(keys.shape[2], device=q.device)[None, :] < ctx_lens[:, None]
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=mask[:, None, None, :], scale=SCALE, enable_gqa=True
    )
    return o.squeeze(2)


def check(name: str, got: torch.Tensor, expected: torch.Tensor, tol: float = 3e-2) -> str:
    err = (got.float() - expected.float()).abs().max().item()
    ok = err <= tol and not math.isnan(err)
    return f"{'ok' if ok else 'FAIL'} (max err {err:.1e})"


def decode_case(batch: int, ctx: int, bw: float) -> None:
    ctx_lens_list = [ctx] * batch
    kv_bytes = sum(ctx_lens_list) * HKV * HEAD_DIM * 2 * DTYPE.itemsize
    layers = paged_layers(ctx_lens_list, kv_bytes, seed=batch + ctx)
    q = torch.randn(batch, HQ, HEAD_DIM, device="cuda", dtype=DTYPE)
    ctx_lens = torch.tensor(ctx_lens_list, device="cuda", dtype=torch.int32)
    kv0, table0 = layers[0]
    ours = decode_mod.paged_decode_attention(q, kv0, table0, ctx_lens, SCALE)
    expected = reference.paged_decode_reference(q, kv0, table0, ctx_lens, SCALE)
    status = check("decode", ours, expected)
    plan = decode_mod.plan_decode(batch, HKV, table0.shape[1], BLOCK, q.device)

    outs = [torch.empty_like(q) for _ in layers]
    t_ours, mode = time_calls(
        [
            (lambda kv=kv, t=t, o=o: decode_mod.paged_decode_attention(q, kv, t, ctx_lens, SCALE, out=o))
            for (kv, t), o in zip(layers, outs, strict=True)
        ]
    )
    t_eager = eager_latency(lambda: decode_mod.paged_decode_attention(q, kv0, table0, ctx_lens, SCALE))
    torch_layers = layers[: max(1, len(layers) // 4)]  # the gather is slow; fewer copies suffice
    t_torch, _ = time_calls([(lambda kv=kv, t=t: torch_decode(q, kv, t, ctx_lens)) for kv, t in torch_layers])
    dense = [
        (
            reference.gather_kv(kv[0], t)[:, :, :ctx].contiguous(),
            reference.gather_kv(kv[1], t)[:, :, :ctx].contiguous(),
        )
        for kv, t in torch_layers
    ]
    t_sdpa, _ = time_calls(
        [
            (
                lambda k=k, v=v: F.scaled_dot_product_attention(
                    q.unsqueeze(2), k, v, scale=SCALE, enable_gqa=True
                )
            )
            for k, v in dense
        ]
    )
    starts = list(range(batch + 1))
    t_fi = time_flashinfer(q, layers, ctx_lens_list, starts, True, expected, tensor_cores=False)
    t_fi_tc = time_flashinfer(q, layers, ctx_lens_list, starts, True, expected, tensor_cores=True)
    gbs = kv_bytes / t_ours / 1e9
    print(
        f"| decode | {batch} | {ctx} | {status} | {plan.num_partitions}x{plan.partition_size} | "
        f"{t_ours * 1e6:.1f} ({mode}) | {t_eager * 1e6:.0f} | {gbs:,.0f} | {gbs * 1e9 / bw:.0%} | "
        f"{t_torch * 1e6:.1f} | {t_torch / t_ours:.1f}x | {t_sdpa * 1e6:.1f} | {t_sdpa / t_ours:.1f}x | "
        f"{t_fi} | {t_fi_tc} |"
    )


def torch_prefill(q, kv, table, q_lens, ctx_lens):
    """engine/attention.py's prefill path: one SDPA per sequence over gathered blocks."""
    out = torch.empty_like(q)
    start = 0
    for s, (q_len, ctx_len) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        keys = reference.gather_kv(kv[0], table[s])[:, :ctx_len]
        values = reference.gather_kv(kv[1], table[s])[:, :ctx_len]
        qs = q[start : start + q_len].transpose(0, 1)
        if q_len == ctx_len:
            o = F.scaled_dot_product_attention(qs, keys, values, is_causal=True, scale=SCALE, enable_gqa=True)
        else:
            rows = torch.arange(q_len, device=q.device)[:, None] + (ctx_len - q_len)
            mask = torch.arange(ctx_len, device=q.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, scale=SCALE, enable_gqa=True)
        out[start : start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


def prefill_case(batch: int, q_len: int, ctx: int, bw: float) -> None:
    q_lens, ctx_lens_list = [q_len] * batch, [ctx] * batch
    kv_bytes = sum(ctx_lens_list) * HKV * HEAD_DIM * 2 * DTYPE.itemsize
    layers = paged_layers(ctx_lens_list, kv_bytes, seed=batch * 7 + ctx)
    layers = layers[: max(1, len(layers) // 8)]  # compute-bound: L2 matters little
    num_tokens = batch * q_len
    q = torch.randn(num_tokens, HQ, HEAD_DIM, device="cuda", dtype=DTYPE)
    q_starts = torch.arange(0, num_tokens + 1, q_len, device="cuda", dtype=torch.int32)
    ctx_lens = torch.tensor(ctx_lens_list, device="cuda", dtype=torch.int32)
    kv0, table0 = layers[0]
    ours = prefill_mod.paged_prefill_attention(q, kv0, table0, q_starts, ctx_lens, SCALE)
    expected = reference.paged_prefill_reference(q, kv0, table0, q_starts, ctx_lens, SCALE)
    status = check("prefill", ours, expected)
    t_ours, mode = time_calls(
        [
            (lambda kv=kv, t=t: prefill_mod.paged_prefill_attention(q, kv, t, q_starts, ctx_lens, SCALE))
            for kv, t in layers
        ]
    )
    t_torch, _ = time_calls(
        [(lambda kv=kv, t=t: torch_prefill(q, kv, t, q_lens, ctx_lens_list)) for kv, t in layers]
    )
    t_fi = time_flashinfer(q, layers, ctx_lens_list, q_starts.cpu().tolist(), False, expected)
    prefix = ctx - q_len
    visible = batch * (q_len * prefix + q_len * (q_len + 1) // 2)  # (query, key) pairs computed
    flops = 4 * HQ * HEAD_DIM * visible
    print(
        f"| prefill | {batch} | {q_len}/{ctx} | {status} | {t_ours * 1e6:.1f} ({mode}) | "
        f"{flops / t_ours / 1e12:.0f} | {kv_bytes / t_ours / 1e9:,.0f} | {t_torch * 1e6:.1f} | "
        f"{flops / t_torch / 1e12:.0f} | {t_torch / t_ours:.1f}x | {t_fi} |"
    )


def write_case(num_tokens: int, bw: float) -> None:
    num_blocks = math.ceil(num_tokens / BLOCK) * 2
    moved = 2 * num_tokens * HKV * HEAD_DIM * DTYPE.itemsize * 2  # K and V, read + written
    num_layers = max(1, min(MAX_LAYERS, math.ceil(L2_FLUSH_BYTES / moved)))
    kvs = [
        torch.zeros(2, num_blocks, HKV, BLOCK, HEAD_DIM, device="cuda", dtype=DTYPE)
        for _ in range(num_layers)
    ]
    qkv = torch.randn(num_tokens, (HQ + 2 * HKV) * HEAD_DIM, device="cuda", dtype=DTYPE)
    k = qkv[:, HQ * HEAD_DIM : (HQ + HKV) * HEAD_DIM].view(num_tokens, HKV, HEAD_DIM)
    v = qkv[:, (HQ + HKV) * HEAD_DIM :].view(num_tokens, HKV, HEAD_DIM)
    slots = torch.randperm(num_blocks * BLOCK, device="cuda")[:num_tokens]
    expected = torch.zeros_like(kvs[0])
    reference.write_kv_reference(expected, k, v, slots)
    write_mod.write_kv(kvs[0], k, v, slots)
    status = "ok" if torch.equal(kvs[0], expected) else "FAIL"
    t_ours, mode = time_calls([(lambda kv=kv: write_mod.write_kv(kv, k, v, slots)) for kv in kvs])
    blocks, offsets = slots // BLOCK, slots % BLOCK

    def torch_write(kv):
        kv[0, blocks, :, offsets] = k
        kv[1, blocks, :, offsets] = v

    t_torch, _ = time_calls([(lambda kv=kv: torch_write(kv)) for kv in kvs])
    t_eager = eager_latency(lambda: write_mod.write_kv(kvs[0], k, v, slots))
    gbs = moved / t_ours / 1e9
    print(
        f"| write_kv | {num_tokens} | {status} | {t_ours * 1e6:.1f} ({mode}) | {t_eager * 1e6:.0f} | {gbs:,.0f} | "
        f"{gbs * 1e9 / bw:.0%} | {t_torch * 1e6:.1f} | {t_torch / t_ours:.1f}x |"
    )


def run_case(fn: Callable, *args) -> None:
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - one broken case must not end the run
        print(f"| {fn.__name__}{args[:-1]} | ERROR: {type(e).__name__}: {str(e)[:200]} |")
        traceback.print_exc(limit=3, file=sys.stdout)
    finally:
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", choices=["decode", "prefill", "write"], default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA device (the CPU tests are tests/kernels/).")
    import triton

    torch.manual_seed(0)
    started = time.perf_counter()
    bw = copy_bandwidth()
    print(
        f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
        f"copy {bw / 1e12:.2f} TB/s | q heads {HQ}, kv heads {HKV}, head_dim {HEAD_DIM}, block {BLOCK}, bf16"
    )
    if args.only in (None, "decode"):
        print(
            "\n| kernel | batch | ctx | check | partitions | ours µs | ours eager µs | GB/s | % copy | "
            "torch µs | speedup | sdpa µs | vs sdpa | fi µs | fi tc µs |"
        )
        print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for batch in (1, 64):
            for ctx in (768, 8192):
                run_case(decode_case, batch, ctx, bw)
    if args.only in (None, "prefill"):
        print(
            "\n| kernel | batch | new/ctx | check | ours µs | TFLOP/s | KV GB/s | torch µs | torch TFLOP/s | speedup "
            "| fi µs |"
        )
        print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for batch, q_len, ctx in ((64, 512, 512), (1, 8192, 8192), (4, 2048, 8192)):
            run_case(prefill_case, batch, q_len, ctx, bw)
    if args.only in (None, "write"):
        print("\n| kernel | tokens | check | ours µs | ours eager µs | GB/s | % copy | torch µs | speedup |")
        print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
        for num_tokens in (64, 32768):
            run_case(write_case, num_tokens, bw)
    print(f"\n(took {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
