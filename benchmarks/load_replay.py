"""Replay a production trace against `splitserve up` with a real benchmark client (aiperf, from PyPI).

    python benchmarks/load_replay.py                          # Azure conversation trace, first 60 s, real time
    python benchmarks/load_replay.py --trace mooncake_synthetic_trace.jsonl --duration-s 30 --time-scale 0.5

What it does:
  1. installs aiperf (pinned) into its own virtual environment, build/aiperf-venv, so the project's
     environment and pins stay untouched;
  2. turns the first --duration-s seconds of the trace (after --time-scale: 0.5 = twice as fast) into
     aiperf's mooncake_trace format, prompt tokens capped at --max-input and prompt + output at
     --max-total (the embedded model has 1024 positions);
  3. starts `splitserve up` (the embedded model on the torch engine, unless --engine sim), waits for READY;
  4. runs `aiperf profile` with --fixed-schedule (requests at the trace's timestamps) against the
     gateway's streaming /v1/completions, tokenizing with the served model's tokenizer;
  5. prints TTFT / ITL p50 / p99, throughput and errors from aiperf's JSON export, and a markdown row.

A benchmark, not a test: nothing asserts; errors are reported (and make the exit status 1).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACES = Path(os.environ.get("SPLITSERVE_TRACES", "/work/shared/data/traces"))
AIPERF = "aiperf==0.13.0"
MODEL_DIR = ROOT / "engine" / "default_model" / "files"


def ensure_aiperf(venv: Path) -> Path:
    binary = venv / "bin" / "aiperf"
    if not binary.exists():
        print(f"== installing {AIPERF} into {venv}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--upgrade", "pip"], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", AIPERF], check=True)
    return binary


def _rows(trace: Path):
    """(seconds since the first request, prompt tokens, output tokens) of each request."""
    if trace.suffix == ".csv":  # Azure LLM inference trace: TIMESTAMP,ContextTokens,GeneratedTokens
        first = None
        with trace.open() as f:
            for row in csv.DictReader(f):
                at = datetime.datetime.fromisoformat(row["TIMESTAMP"][:26])
                first = first or at
                yield (at - first).total_seconds(), int(row["ContextTokens"]), int(row["GeneratedTokens"])
    else:  # Mooncake: {"timestamp": ms, "input_length", "output_length", "hash_ids"}
        with trace.open() as f:
            for line in f:
                r = json.loads(line)
                yield r["timestamp"] / 1000.0, int(r["input_length"]), int(r["output_length"])


def convert(trace: Path, out: Path, duration_s: float, time_scale: float, max_input: int, max_total: int) -> int:
    """Writes aiperf's mooncake_trace JSONL; returns the number of requests."""
    count = 0
    with out.open("w") as f:
        for at, num_in, num_out in _rows(trace):
            at *= time_scale
            if at > duration_s:
                break
            num_in = max(1, min(num_in, max_input))
            num_out = max(1, min(num_out, max_total - num_in))
            f.write(json.dumps({"timestamp": int(at * 1000), "input_length": num_in, "output_length": num_out}) + "\n")
            count += 1
    return count


def start_cluster(work: Path, engine: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "splitserve", "up", "--port", "0", "--work-dir", str(work), "--engine", engine, *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))  # fmt: skip
    for line in proc.stdout:
        print(f"   up| {line.rstrip()}", flush=True)
        if line.startswith("READY "):
            return proc, line.split()[1]
    raise RuntimeError(f"splitserve up exited with {proc.wait()} before READY; logs in {work / 'logs'}")


def stop_cluster(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def summarize(export: Path) -> dict:
    data = json.loads(export.read_text())

    def metric(name: str) -> dict:
        value = data.get(name) or {}
        return value if isinstance(value, dict) else {"avg": value}

    errors = [e for e in data.get("error_summary") or [] if isinstance(e, dict)]
    refused = sum(e.get("count", 0) for e in errors if (e.get("error_details") or {}).get("code") == 429)
    return {
        "requests": metric("request_count").get("avg"),
        "refused_429": refused,
        "errors": sum(e.get("count", 0) for e in errors) - refused,
        "error_kinds": {(e.get("error_details") or {}).get("type", "?"): e.get("count", 0) for e in errors},
        "ttft_ms": metric("time_to_first_token"),
        "itl_ms": metric("inter_token_latency"),
        "request_latency_ms": metric("request_latency"),
        "output_tokens_per_s": metric("output_token_throughput").get("avg"),
        "requests_per_s": metric("request_throughput").get("avg"),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default="azure_llm_2023_conv.csv", help="file in $SPLITSERVE_TRACES (default %(default)s)")
    p.add_argument("--duration-s", type=float, default=60.0, help="replay this much of the (scaled) trace")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply the trace's timestamps (0.5 = 2x rate)")
    p.add_argument("--max-input", type=int, default=640, help="cap of prompt tokens (default %(default)s)")
    p.add_argument("--max-total", type=int, default=896, help="cap of prompt + output tokens (default %(default)s)")
    p.add_argument("--engine", choices=["torch", "sim"], default="torch")
    p.add_argument("--up-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `splitserve up`, e.g. --up-arg=--router-arg=--ttft-slo-s=2 (repeatable)")
    p.add_argument("--out", type=Path, default=ROOT / "build" / "load_replay", help="work dir and aiperf artifacts")
    args = p.parse_args()

    aiperf = ensure_aiperf(ROOT / "build" / "aiperf-venv")
    args.out.mkdir(parents=True, exist_ok=True)
    dataset = args.out / "trace.jsonl"
    num = convert(TRACES / args.trace, dataset, args.duration_s, args.time_scale, args.max_input, args.max_total)
    print(f"== {num} requests from {args.trace} (first {args.duration_s:g} s at time scale {args.time_scale:g})", flush=True)
    proc, url = start_cluster(args.out / "up", args.engine, args.up_arg)
    try:
        artifacts = args.out / "aiperf"
        cmd = [str(aiperf), "profile", "--model", "splitserve-default", "--url", url, "--endpoint-type", "completions",
               "--streaming", "--tokenizer", str(MODEL_DIR), "--custom-dataset-type", "mooncake_trace",
               "--input-file", str(dataset), "--fixed-schedule", "--output-artifact-dir", str(artifacts),
               "--request-timeout-seconds", "120", "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
               "--random-seed", "0"]  # fmt: skip
        print("== " + " ".join(cmd), flush=True)
        started = time.monotonic()
        run = subprocess.run(cmd, cwd=args.out)  # a local tokenizer path: aiperf needs no hub (nor offline mode)
        took = time.monotonic() - started
    finally:
        stop_cluster(proc)
    exports = sorted(artifacts.rglob("profile_export_aiperf.json"))
    if run.returncode or not exports:
        print(f"aiperf failed (exit {run.returncode}); artifacts in {artifacts}")
        return 1
    s = summarize(exports[-1])
    s.update(trace=args.trace, duration_s=args.duration_s, time_scale=args.time_scale, engine=args.engine,
             up_args=args.up_arg,
             num_scheduled=num, wall_s=round(took, 1))  # fmt: skip
    print(json.dumps(s, indent=2))
    t, i = s["ttft_ms"], s["itl_ms"]
    print(f"\n| {args.trace} {args.duration_s:g} s ×{1 / args.time_scale:g} {' '.join(args.up_arg)} | {args.engine} | "
          f"{s['requests']:.0f} | {s['refused_429']} | {s['errors']} | "
          f"{t.get('p50', float('nan')):.1f} / {t.get('p99', float('nan')):.1f} | "
          f"{i.get('p50', float('nan')):.2f} / {i.get('p99', float('nan')):.2f} | {s['output_tokens_per_s']:.0f} |")
    return 1 if s["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
