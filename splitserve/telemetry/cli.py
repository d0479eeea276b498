"""`splitserve trace report FILE...`: exported spans -> TTFT breakdown table + PNG waterfall."""

from __future__ import annotations

import argparse
import json
import sys

DESCRIPTION = """\
Read spans exported by splitserve processes (OTEL_TRACES_EXPORTER=jsonl files, the console
exporter's output, or OTLP/JSON files; directories are read whole) and show where each
request's time to first token went: a table of the phases on the path to the first token
(queue waits, compute, handoff, RPC hops) and a PNG waterfall of one request's spans."""

EPILOG = """\
example:
  OTEL_TRACES_EXPORTER=jsonl SPLITSERVE_TRACES_FILE=/tmp/spans.jsonl splitserve up --engine sim
  curl -s localhost:8000/v1/completions -d '{"prompt": "hello", "max_tokens": 8}' >/dev/null
  splitserve trace report /tmp/spans.jsonl --out ttft.png"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True, help="report: TTFT breakdown of exported spans")
    report = sub.add_parser("report", help="TTFT breakdown table and PNG waterfall from exported spans")
    report.add_argument("files", nargs="+", metavar="FILE", help="span export files or directories")
    report.add_argument("--out", default="ttft-waterfall.png", metavar="PNG",
                        help="where to write the waterfall of one request (default %(default)s)")  # fmt: skip
    report.add_argument("--trace-id", default=None, metavar="HEX",
                        help="the request to draw (default: the slowest to first token)")  # fmt: skip
    report.add_argument("--all", action="store_true", help="also print the breakdown of every request")
    report.add_argument("--json", action="store_true", help="print the breakdowns as JSON instead of tables")
    report.add_argument("--no-png", action="store_true", help="print the table only")


def run(args: argparse.Namespace) -> int:
    from splitserve.telemetry.report import (
        breakdown_json,
        format_table,
        load_traces,
        render_waterfall,
        ttft_breakdown,
    )

    try:
        traces = load_traces(args.files)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    breakdowns = {tid: ttft_breakdown(spans) for tid, spans in traces.items() if spans}
    breakdowns = {tid: b for tid, b in breakdowns.items() if b.ttft_ms > 0 and b.phases}  # requests, not /health
    if not breakdowns:
        print(f"error: no spans found in {', '.join(args.files)}", file=sys.stderr)
        return 1
    trace_id = (args.trace_id or "").lower().removeprefix("0x")
    if trace_id and trace_id not in breakdowns:
        print(f"error: trace {trace_id} is not in the files ({len(breakdowns)} traces)", file=sys.stderr)
        return 1
    chosen = breakdowns[trace_id] if trace_id else max(breakdowns.values(), key=lambda b: b.ttft_ms)
    if args.json:
        print(json.dumps({"traces": [breakdown_json(b) for b in breakdowns.values()], "drawn": chosen.trace_id}, indent=2))
    else:
        if len(breakdowns) > 1:
            print(format_table(list(breakdowns.values())), end="\n\n")
        for b in breakdowns.values() if args.all else [chosen]:
            print(format_table([b]), end="\n\n")
    if not args.no_png:
        path = render_waterfall(traces[chosen.trace_id], chosen, args.out)
        print(f"waterfall of trace {chosen.trace_id}: {path}", file=sys.stderr)
    return 0
