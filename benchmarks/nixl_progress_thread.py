"""What a NIXL agent's progress thread costs the compute sharing its core, side by side in one run.

NIXL's Python API starts its UCX progress thread with a zero poll timeout: it spins for the
agent's whole life. On a core of its own that is only a burnt core; on a core the engine computes
on, it takes about half of it. This runs the same CPU prefill (the engine on one core, one torch
thread) in fresh processes: without an agent; with an agent whose thread spins (NIXL's setting,
`progress_delay_us=0`); with our default poll timeout (`nixl_transport.PROGRESS_DELAY_US`: the
thread sleeps until UCX's event fd wakes it — how prefill workers run); and without a progress
thread (how decode workers run), in rotation, and prints each median over the no-agent one.

    python benchmarks/nixl_progress_thread.py [--tokens 2000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("no agent", "agent, spinning thread (NIXL's)", "agent, thread with poll timeout", "agent, no progress thread")


def child(mode: str, model: str, tokens: int) -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import torch

    torch.set_num_threads(1)
    from splitserve import LLM, SamplingParams

    if mode != MODES[0]:
        from splitserve.engine.transfer.nixl_transport import NixlTransport

        agent = NixlTransport(progress_thread=mode != MODES[3], progress_delay_us=0 if mode == MODES[1] else None)  # noqa: F841
    llm = LLM(model, block_size_tokens=16, num_blocks=tokens // 16 + 8, max_tokens=tokens)
    params = SamplingParams(num_tokens_to_generate=1, temperature=0.0)
    times = []
    for i in range(4):  # the first one warms up
        prompt = [(7 * i + j) % 500 + 3 for j in range(tokens)]
        started = time.perf_counter()
        llm.generate([prompt], params)
        times.append(time.perf_counter() - started)
    print(statistics.median(times[1:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2000, help="prompt length")
    p.add_argument("--rounds", type=int, default=2, help="rotations over the modes")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.fixtures.models import build_hf_checkpoint

    results: dict[str, list[float]] = {m: [] for m in MODES}
    env = dict(os.environ, UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"), NIXL_LOG_LEVEL="WARN")
    with tempfile.TemporaryDirectory() as model:
        build_hf_checkpoint(model, "llama", num_hidden_layers=4, hidden_size=256, intermediate_size=1024,
                            max_position_embeddings=max(4096, args.tokens))  # fmt: skip
        for r in range(args.rounds):
            for mode in MODES:
                out = subprocess.run([sys.executable, __file__, "--child", mode, model, str(args.tokens)],
                                     capture_output=True, text=True, env=env, check=True)  # fmt: skip
                results[mode].append(float(out.stdout.strip().splitlines()[-1]))
                print(f"round {r + 1}: {mode:32s} {results[mode][-1] * 1e3:8.0f} ms", flush=True)
    base = statistics.median(results[MODES[0]])
    print(f"\nprefill of {args.tokens} tokens on one core (medians):")
    for mode in MODES:
        m = statistics.median(results[mode])
        print(f"  {mode:32s} {m * 1e3:8.0f} ms   {m / base:5.2f}x the no-agent time")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
