"""Launch settings of the decode kernels swept inside the engine's decode graph (GPU).

Our projection and attention settings were tuned in isolation (a 16-layer chain of one kernel and
its neighbour, `benchmarks/projections.py`), but under programmatic dependent launch a kernel's
speed in the step depends on what runs beside it: which programs fit on a multiprocessor next to
the previous kernel's, and how its launch overlaps their drain (benchmarks/RESULTS.md, sessions
20 and 22: an attention setting 8% faster alone made the step 15% slower). This sweep builds the
engine once on the Llama-3.2-1B shape (random bf16 weights), and for each candidate setting
re-captures the decode graph of one batch size and times its replay; every round times the
committed settings at its start, middle and end, so a candidate is read against the noise of the
same run. Candidates (`--only` picks kinds, `--candidates` replaces the list):

- `qkv|o|gate_up|down=BN,BK,WARPS,STAGES[,SPLITS]`: that projection's config for 17..64 rows
  (`kernels.projection_configs`); `qkv_small=...` etc.: its config for 1..16 rows;
- `lm_head=BN,BK,WARPS,STAGES`: the LM head's config (`kernels.decode_linear`'s default);
- `attn=BLOCK_N,WARPS,STAGES`: the unsplit decode attention's token step and launch settings;
- `greedy=pass`: the greedy tokens taken by an argmax pass over the logits
  (`kernels.argmax_rows`) instead of from the LM head's epilogue;
- `rope=compute`: cos / sin computed each step instead of gathered from the table;
  `rope=rows`: gathered from the table by torch, the rows passed to the qkv kernel (session 31's
  form) instead of gathered by the qkv kernel itself (`engine.models.fused.GATHER_ROTARY`);
- `tail=torch`: the last layer's down projection added to the residual stream by torch (sum,
  cast, add) instead of `kernels.add_residual`;
- `embed=torch`: the token embedding looked up by torch's kernel instead of the first norm's
  (`engine.models.fused.GATHER_EMBEDDING`);
- `norm=WARPS`: the RMSNorm kernels' warps (`kernels.norm.NUM_WARPS`);
- `logits=all`: the LM head stores every row's logits, also those of greedy rows that need only
  their argmax (`engine.cuda_graphs.SKIP_UNREAD_LOGITS`);
- `early=all`: every projection (not only split ones) loads its first weight tile before the PDL
  wait (`kernels.linear.early_weights`).

    python3 benchmarks/decode_sweep.py --batch 64 [--only o,down] [--rounds 2] [--budget-s 480]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_profile import CFG, generate, replay_time  # noqa: E402

from engine import copy_bandwidth, make_checkpoint  # noqa: E402

CANDIDATES = {
    "qkv": ["16,256,4,4", "16,512,4,3", "32,128,4,4", "32,128,4,6", "32,256,4,3", "32,256,8,4", "64,128,4,4",
            "16,128,2,6"],
    "o": ["16,128,4,4", "16,128,4,6", "16,256,4,3", "16,256,2,4", "16,512,4,2", "32,128,4,4", "32,256,4,4",
          "16,256,8,4"],
    "gate_up": ["32,128,4,4", "64,128,4,4", "64,128,8,3", "64,64,4,5", "128,128,4,3", "128,64,4,4", "32,256,4,3",
                "64,256,4,2"],
    "down": ["64,128,4,4,2", "64,128,4,4,8", "32,128,4,4,4", "32,256,4,3,4", "64,128,4,3,4", "64,64,4,6,4",
             "128,128,4,4,8", "16,256,4,4,1", "16,512,4,3,1"],
    "lm_head": ["64,128,4,4", "64,128,4,3", "128,64,4,6", "128,256,4,3", "64,256,4,3", "128,128,8,4",
                "256,64,8,4", "256,128,8,3", "32,256,4,4"],
    "attn": ["64,4,3", "64,2,4", "32,2,6", "128,4,4", "128,8,3", "64,4,4", "256,8,2"],
    "early": ["all"],
    "greedy": ["pass"],
    "rope": ["compute", "rows"],
    "tail": ["torch"],
    "logits": ["all"],
    "embed": ["torch"],
    "norm": ["2", "8"],
}


def apply(kind: str, value: str):
    """Put candidate `kind=value` in place; returns the function that undoes it."""
    from splitserve import kernels
    from splitserve.kernels import decode_plan, linear, projection_configs

    proj = kind.removesuffix("_small")
    if proj in projection_configs.PROJECTION_CONFIGS:
        old = projection_configs.PROJECTION_CONFIGS[proj]
        config = linear.LinearConfig(*map(int, value.split(",")))
        projection_configs.PROJECTION_CONFIGS[proj] = (config, old[1]) if kind != proj else (old[0], config)
        return lambda: projection_configs.PROJECTION_CONFIGS.__setitem__(proj, old)
    if kind == "lm_head":  # the LM head runs decode_linear's default config
        old_defaults = linear.LinearConfig.__new__.__defaults__
        linear.LinearConfig.__new__.__defaults__ = (*map(int, value.split(",")), 1)
        return lambda: setattr(linear.LinearConfig.__new__, "__defaults__", old_defaults)
    if kind == "attn":
        block_n, warps, stages = map(int, value.split(","))
        old_fn, old_bn = kernels.paged_decode_attention, decode_plan._UNSPLIT_BLOCK_N
        kernels.paged_decode_attention = functools.partial(old_fn, num_warps=warps, num_stages=stages)
        decode_plan._UNSPLIT_BLOCK_N = block_n

        def undo():
            kernels.paged_decode_attention, decode_plan._UNSPLIT_BLOCK_N = old_fn, old_bn
        return undo
    if kind == "early" and value == "all":
        old_early = linear.early_weights
        linear.early_weights = lambda ranges: True
        return lambda: setattr(linear, "early_weights", old_early)
    if kind == "greedy" and value == "pass":
        from splitserve.engine.models.llama import CausalLM

        old_head = CausalLM.logits_and_argmax
        CausalLM.logits_and_argmax = lambda self, hidden, keep_rows=None: (self.compute_logits(hidden), None)
        return lambda: setattr(CausalLM, "logits_and_argmax", old_head)
    if kind == "rope" and value == "compute":
        from splitserve.engine.models.rope import RotaryEmbedding

        old_table = RotaryEmbedding._table
        RotaryEmbedding._table = lambda self, device, dtype: None
        return lambda: setattr(RotaryEmbedding, "_table", old_table)
    if kind == "tail" and value == "torch":
        old_add = kernels.add_residual
        kernels.add_residual = lambda x, residual: residual + (x.sum(0).to(residual.dtype) if x.dim() == 3 else x)
        return lambda: setattr(kernels, "add_residual", old_add)
    from splitserve.engine import cuda_graphs
    from splitserve.engine.models import fused
    from splitserve.kernels import norm

    switches = {("logits", "all"): (cuda_graphs, "SKIP_UNREAD_LOGITS", False),
                ("rope", "rows"): (fused, "GATHER_ROTARY", False),
                ("embed", "torch"): (fused, "GATHER_EMBEDDING", False)}
    if kind == "norm":
        switches[kind, value] = (norm, "NUM_WARPS", int(value))
    if (kind, value) in switches:  # a module setting, read at the next capture
        module, name, setting = switches[kind, value]
        old_setting = getattr(module, name)
        setattr(module, name, setting)
        return lambda: setattr(module, name, old_setting)
    raise SystemExit(f"unknown candidate {kind}={value}")


def measure(llm, prompts, new_tokens: int, iters: int) -> float:
    """Re-capture the decode graph under the settings in place now; its replay time (s)."""
    from splitserve import SamplingParams

    llm.engine.runner.graphs.reset()
    llm.engine.pool.reset_prefix_cache()
    generate(llm, prompts, SamplingParams(num_tokens_to_generate=new_tokens, ignore_eos=True, temperature=0.0), 0)
    return replay_time(llm, len(prompts), iters)


def main() -> None:
    from splitserve import LLM

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128, help="decode steps before the replay is timed "
                   "(the graph replays the last step's context: 512 + this many tokens)")
    p.add_argument("--only", default=",".join(CANDIDATES), help="kinds to sweep, comma-separated")
    p.add_argument("--candidates", default=None, help="KIND=VALUE;KIND=VALUE... instead of the built-in list")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iters", type=int, default=100, help="replays timed per measurement")
    p.add_argument("--budget-s", type=float, default=480, help="start no new measurement past this many seconds")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_sweep needs a CUDA device")
    if args.candidates:
        cands = [tuple(c.split("=", 1)) for c in args.candidates.split(";") if c]
    else:
        cands = [(kind, v) for kind in args.only.split(",") for v in CANDIDATES[kind]]
    start = time.perf_counter()
    bw = copy_bandwidth()
    params = 128256 * 2048 + 16 * (2 * 2048 * 2048 + 2 * 512 * 2048 + 3 * 2048 * 8192)
    roof = (2 * params + args.batch * (512 + args.new_tokens) * 16 * 2 * 8 * 64 * 2) / bw
    results: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(Path(tmp), CFG, torch.bfloat16, "cuda")
        llm = LLM(tmp, device="cuda", block_size_tokens=16, buffer_size_gb=20, max_tokens=32768, max_requests=128)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(10, 1000, (512,), generator=g).tolist() for _ in range(args.batch)]
        base = ("committed", "")
        done = False
        for _ in range(args.rounds):
            half = len(cands) // 2
            order = [base, *cands[:half], base, *cands[half:], base]
            for cand in order:
                if time.perf_counter() - start > args.budget_s:
                    done = True
                    break
                undo = apply(*cand) if cand is not base else (lambda: None)
                try:
                    seconds = measure(llm, prompts, args.new_tokens, args.iters)
                except Exception as exc:  # noqa: BLE001 - a setting that does not compile or fit: reported
                    print(f"{cand[0]}={cand[1]}: failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    seconds = float("nan")
                finally:
                    undo()
                results.setdefault(cand, []).append(seconds)
                print(f"{cand[0]}={cand[1]}: replay {seconds * 1e3:.3f} ms", flush=True)
            if done:
                break
    ref = statistics.median(results[base])
    print(f"\ncopy bandwidth {bw / 1e12:.2f} TB/s; batch {args.batch}, context {512 + args.new_tokens}; "
          f"roofline step {roof * 1e3:.3f} ms; committed replays (ms): "
          + ", ".join(f"{s * 1e3:.3f}" for s in results[base]))
    print(f"{'candidate':<28} {'replay ms (each round)':<26} {'median':>8} {'vs committed':>12} {'/roofline':>10}")
    rows = sorted(((statistics.median(v), k, v) for k, v in results.items()), key=lambda r: (r[0] != r[0], r[0]))
    for med, (kind, value), runs in rows:
        name = kind if not value else f"{kind}={value}"
        each = ", ".join(f"{s * 1e3:.3f}" for s in runs)
        print(f"{name:<28} {each:<26} {med * 1e3:>8.3f} {med / ref - 1:>+12.2%} {roof / med:>10.1%}")


if __name__ == "__main__":
    main()
