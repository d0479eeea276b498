"""Exported spans -> the TTFT breakdown of each request: a table and a PNG waterfall.

    traces = load_traces(["spans.jsonl"])            # jsonl / console / OTLP-JSON exports, mixed
    b = ttft_breakdown(traces[trace_id])              # phases on the path to the first token
    print(format_table([b]))
    render_waterfall(traces[trace_id], b, "ttft.png")

The breakdown of one trace:

    TTFT      root span start -> its `first_token` event (gateway) or, without a gateway, the
              root's `first_message` event (the router's first chunk sent)
    phases    leaf spans marked `splitserve.ttft_phase`, clipped to the TTFT
    rpc.*     for each client span (`splitserve.rpc`) whose server span lies on the path: the
              time outside the server span until the first reply message (network,
              serialization, gRPC queues) — measured on both ends of the hop
    failed    client spans that ended in an error before the first token (retried attempts)
    unaccounted  TTFT - all of the above (in-process gaps the spans do not cover)
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from splitserve.telemetry.spans import FIRST_MESSAGE, FIRST_TOKEN, RPC, TTFT_PHASE


@dataclass
class SpanRecord:
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    kind: str
    start_ns: int
    end_ns: int
    service: str
    attributes: dict = field(default_factory=dict)
    events: dict[str, int] = field(default_factory=dict)
    """Event name -> time (ns) of its first occurrence."""
    is_error: bool = False

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


# ------------------------------------------------------------------ loading
def _hex(value) -> str:
    return str(value or "").lower().removeprefix("0x")


def _iso_ns(text: str | None) -> int:
    if not text:
        return 0
    return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1e6) * 1000


def _from_console(d: dict) -> SpanRecord:
    """ConsoleSpanExporter's to_json() shape (also our jsonl, which adds exact ns times)."""
    ctx = d.get("context") or {}
    resource = (d.get("resource") or {}).get("attributes") or {}
    events = {}
    for e in d.get("events") or ():
        events.setdefault(e["name"], e.get("time_unix_nano") or _iso_ns(e.get("timestamp")))
    return SpanRecord(
        trace_id=_hex(ctx.get("trace_id")), span_id=_hex(ctx.get("span_id")),
        parent_id=_hex(d.get("parent_id")) or None, name=d["name"], kind=str(d.get("kind", "")).split(".")[-1],
        start_ns=d.get("start_time_unix_nano") or _iso_ns(d.get("start_time")),
        end_ns=d.get("end_time_unix_nano") or _iso_ns(d.get("end_time")),
        service=str(resource.get("service.name", "")), attributes=dict(d.get("attributes") or {}), events=events,
        is_error=(d.get("status") or {}).get("status_code") == "ERROR",
    )  # fmt: skip


def _otlp_value(v: dict):
    for key in ("stringValue", "boolValue", "doubleValue"):
        if key in v:
            return v[key]
    if "intValue" in v:
        return int(v["intValue"])
    return json.dumps(v)


_OTLP_KINDS = {1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER",
               "SPAN_KIND_INTERNAL": "INTERNAL", "SPAN_KIND_SERVER": "SERVER", "SPAN_KIND_CLIENT": "CLIENT"}  # fmt: skip


def _from_otlp(d: dict) -> list[SpanRecord]:
    """An OTLP/JSON export (`{"resourceSpans": [...]}`, e.g. a collector's file exporter)."""
    out = []
    for rs in d.get("resourceSpans", ()):
        resource = {a["key"]: _otlp_value(a["value"]) for a in (rs.get("resource") or {}).get("attributes", ())}
        for ss in rs.get("scopeSpans", ()):
            for s in ss.get("spans", ()):
                events = {}
                for e in s.get("events", ()):
                    events.setdefault(e["name"], int(e.get("timeUnixNano", 0)))
                out.append(SpanRecord(
                    trace_id=_hex(s["traceId"]), span_id=_hex(s["spanId"]), parent_id=_hex(s.get("parentSpanId")) or None,
                    name=s["name"], kind=_OTLP_KINDS.get(s.get("kind"), str(s.get("kind", ""))),
                    start_ns=int(s["startTimeUnixNano"]),
                    end_ns=int(s["endTimeUnixNano"]), service=str(resource.get("service.name", "")),
                    attributes={a["key"]: _otlp_value(a["value"]) for a in s.get("attributes", ())}, events=events,
                    is_error=(s.get("status") or {}).get("code") in (2, "STATUS_CODE_ERROR"),
                ))  # fmt: skip
    return out


def parse_spans(text: str) -> list[SpanRecord]:
    """Every span in `text`: JSON objects one per line or spread over lines (console exporter),
    other lines (logs) skipped."""
    decoder = json.JSONDecoder()
    spans: list[SpanRecord] = []
    i, n = 0, len(text)
    while i < n:
        start = text.find("{", i)
        if start < 0:
            break
        try:
            obj, end = decoder.raw_decode(text, start)
        except ValueError:
            i = text.find("\n", start)
            i = n if i < 0 else i + 1
            continue
        i = end
        if not isinstance(obj, dict):
            continue
        if "resourceSpans" in obj:
            spans += _from_otlp(obj)
        elif "name" in obj and "context" in obj:
            spans.append(_from_console(obj))
    return spans


def load_traces(paths: Iterable[str | Path]) -> dict[str, list[SpanRecord]]:
    """trace id -> its spans (sorted by start) from export files; a directory means its files."""
    spans: list[SpanRecord] = []
    for path in map(Path, paths):
        files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
        for f in files:
            spans += parse_spans(f.read_text(errors="replace"))
    traces: dict[str, list[SpanRecord]] = defaultdict(list)
    seen = set()
    for s in spans:
        if (s.trace_id, s.span_id) not in seen:
            seen.add((s.trace_id, s.span_id))
            traces[s.trace_id].append(s)
    return {t: sorted(v, key=lambda s: s.start_ns) for t, v in traces.items()}


# ---------------------------------------------------------------- breakdown
@dataclass(frozen=True)
class Phase:
    name: str
    service: str
    start_ns: int
    ms: float
    kind: str
    """"span" (a measured phase span), "rpc" (a hop's network time), "failed" (failed attempts)."""


@dataclass(frozen=True)
class Breakdown:
    trace_id: str
    root: SpanRecord
    ttft_ms: float
    phases: tuple[Phase, ...]

    @property
    def accounted_ms(self) -> float:
        return sum(p.ms for p in self.phases)

    @property
    def unaccounted_ms(self) -> float:
        return self.ttft_ms - self.accounted_ms


def root_span(spans: list[SpanRecord]) -> SpanRecord:
    ids = {s.span_id for s in spans}
    roots = [s for s in spans if s.parent_id is None or s.parent_id not in ids]
    return min(roots or spans, key=lambda s: s.start_ns)


def ttft_breakdown(spans: list[SpanRecord]) -> Breakdown:
    root = root_span(spans)
    end = root.events.get(FIRST_TOKEN) or root.events.get(FIRST_MESSAGE) or root.end_ns
    children: dict[str, list[SpanRecord]] = defaultdict(list)
    for s in spans:
        if s.parent_id:
            children[s.parent_id].append(s)

    def has_phase(span: SpanRecord) -> bool:
        return bool(span.attributes.get(TTFT_PHASE)) or any(has_phase(c) for c in children[span.span_id])

    phases = []
    for s in spans:
        if s.start_ns >= end:
            continue
        if s.attributes.get(TTFT_PHASE):
            phases.append(Phase(s.name, s.service, s.start_ns, (min(s.end_ns, end) - s.start_ns) / 1e6, "span"))
        elif s.attributes.get(RPC) and s.is_error:
            phases.append(Phase(f"failed {s.name}", s.service, s.start_ns, (min(s.end_ns, end) - s.start_ns) / 1e6, "failed"))
        elif s.attributes.get(RPC):
            servers = [c for c in children[s.span_id] if c.kind.upper().endswith("SERVER") and has_phase(c)]
            if not servers:
                continue
            server = servers[0]
            # Request leg: client start -> server start. Reply leg: the server's first reply message
            # (a unary call's: its end) -> the client receiving it.
            client_first = s.events.get(FIRST_MESSAGE, s.end_ns)
            server_first = server.events.get(FIRST_MESSAGE, server.end_ns)
            ms = (server.start_ns - s.start_ns + client_first - server_first) / 1e6
            hop = f"rpc {s.service.removeprefix('splitserve-')}->{server.service.removeprefix('splitserve-')}"
            phases.append(Phase(hop, s.service, s.start_ns, max(0.0, ms), "rpc"))
    phases.sort(key=lambda p: p.start_ns)
    return Breakdown(root.trace_id, root, (end - root.start_ns) / 1e6, tuple(phases))


# -------------------------------------------------------------------- table
def format_table(breakdowns: list[Breakdown]) -> str:
    """One request: its phases in order. Several: mean / p50 / max per phase and share of the mean TTFT."""
    if not breakdowns:
        return "no traces with spans found"
    if len(breakdowns) == 1:
        b = breakdowns[0]
        rows = [(p.name, p.service, f"{p.ms:9.2f}", f"{100 * p.ms / b.ttft_ms:5.1f}%") for p in b.phases]
        rows.append(("unaccounted", "", f"{b.unaccounted_ms:9.2f}", f"{100 * b.unaccounted_ms / b.ttft_ms:5.1f}%"))
        header = f"trace {b.trace_id}  root {b.root.name!r} ({b.root.service})  TTFT {b.ttft_ms:.2f} ms\n"
        widths = [max(len(r[i]) for r in [*rows, ("phase", "process", "ms", "share")]) for i in range(4)]
        lines = [header + "  ".join(h.ljust(w) for h, w in zip(("phase", "process", "ms", "share"), widths, strict=True))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        lines.append(f"{'sum of phases':<{widths[0]}}  {'':<{widths[1]}}  {b.accounted_ms:9.2f}  "
                     f"{100 * b.accounted_ms / b.ttft_ms:5.1f}%")  # fmt: skip
        return "\n".join(lines)
    by_name: dict[str, list[float]] = defaultdict(list)
    order: list[str] = []
    for b in breakdowns:
        seen: dict[str, float] = defaultdict(float)
        for p in b.phases:
            seen[p.name] += p.ms
        seen["unaccounted"] = b.unaccounted_ms
        for name, ms in seen.items():
            if name not in order:
                order.append(name)
            by_name[name].append(ms)
    ttfts = [b.ttft_ms for b in breakdowns]
    mean_ttft = statistics.fmean(ttfts)
    lines = [f"{len(breakdowns)} requests  TTFT mean {mean_ttft:.2f} ms  p50 {statistics.median(ttfts):.2f} ms  "
             f"max {max(ttfts):.2f} ms", f"{'phase':<28} {'n':>4} {'mean ms':>9} {'p50 ms':>9} {'max ms':>9} {'share':>6}"]  # fmt: skip
    for name in order:
        v = by_name[name]
        mean = sum(v) / len(breakdowns)
        lines.append(f"{name:<28} {len(v):>4} {mean:>9.2f} {statistics.median(v):>9.2f} {max(v):>9.2f} "
                     f"{100 * mean / mean_ttft:>5.1f}%")  # fmt: skip
    return "\n".join(lines)


def breakdown_json(b: Breakdown) -> dict:
    return {
        "trace_id": b.trace_id, "ttft_ms": b.ttft_ms, "accounted_ms": b.accounted_ms, "unaccounted_ms": b.unaccounted_ms,
        "phases": [{"name": p.name, "service": p.service, "ms": p.ms, "kind": p.kind} for p in b.phases],
    }  # fmt: skip


# ---------------------------------------------------------------- waterfall
def render_waterfall(spans: list[SpanRecord], breakdown: Breakdown, out: str | Path) -> Path:
    """A PNG: every span of the trace as a bar (by start, indented by depth, colored by process),
    the TTFT line, and below it the TTFT breakdown as one stacked bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    root = breakdown.root
    t0 = root.start_ns
    by_id = {s.span_id: s for s in spans}

    def depth(s: SpanRecord) -> int:
        d = 0
        while s.parent_id in by_id and d < 32:
            s, d = by_id[s.parent_id], d + 1
        return d

    ordered = _tree_order(spans, root)
    services = sorted({s.service for s in spans})
    palette = plt.get_cmap("tab10")
    colors = {name: palette(i % 10) for i, name in enumerate(services)}
    height = max(5.0, 0.32 * len(ordered) + 3.6)
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(13, height), gridspec_kw={"height_ratios": [max(3, len(ordered)), 1.6]})
    for row, s in enumerate(ordered):
        start, width = (s.start_ns - t0) / 1e6, max(s.duration_ms, 0.05)
        is_phase = bool(s.attributes.get(TTFT_PHASE))
        ax.barh(row, width, left=start, color=colors[s.service], edgecolor="black" if is_phase else "none",
                hatch="//" if s.is_error else None, height=0.7)  # fmt: skip
        label = f"{'  ' * depth(s)}{s.name}"
        ax.text(-0.01, row, label, transform=ax.get_yaxis_transform(), ha="right", va="center", fontsize=8,
                fontweight="bold" if is_phase else "normal")  # fmt: skip
        ax.text(start + width, row, f" {s.duration_ms:.1f} ms", va="center", fontsize=7)
    ax.axvline(breakdown.ttft_ms, color="crimson", linestyle="--", linewidth=1.2)
    ax.text(breakdown.ttft_ms, len(ordered) - 0.6, f" TTFT {breakdown.ttft_ms:.1f} ms", color="crimson", fontsize=9,
            va="bottom")  # fmt: skip
    ax.set_yticks([])
    ax.set_ylim(len(ordered) - 0.5, -1.2)
    ax.set_xlabel("ms since the request arrived")
    ax.set_title(f"trace {breakdown.trace_id} — spans (bold outline: on the path to the first token)", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in services]
    ax.legend(handles, services, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)

    left = 0.0
    phase_palette = plt.get_cmap("tab20")
    parts = [(p.name, p.ms) for p in breakdown.phases] + [("unaccounted", max(0.0, breakdown.unaccounted_ms))]
    bars = []
    for i, (name, ms) in enumerate(parts):
        color = "lightgrey" if name == "unaccounted" else phase_palette(i % 20)
        bars.append(bx.barh(0, ms, left=left, color=color, edgecolor="white", label=f"{name} {ms:.1f} ms"))
        if ms > 0.12 * breakdown.ttft_ms:
            bx.text(left + ms / 2, 0, f"{name}\n{ms:.1f} ms", ha="center", va="center", fontsize=7)
        left += ms
    bx.legend(loc="upper center", bbox_to_anchor=(0.5, -0.85), ncol=4, fontsize=7, frameon=False)
    bx.set_xlim(0, max(left, breakdown.ttft_ms) * 1.01)
    bx.set_yticks([])
    bx.set_xlabel("ms since the request arrived", fontsize=8)
    bx.set_title(f"TTFT breakdown: phases sum to {breakdown.accounted_ms:.1f} of {breakdown.ttft_ms:.1f} ms "
                 f"({100 * breakdown.accounted_ms / breakdown.ttft_ms:.1f}%)", fontsize=10)  # fmt: skip
    fig.subplots_adjust(left=0.2, right=0.83, top=0.95, bottom=0.14, hspace=0.35)
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _tree_order(spans: list[SpanRecord], root: SpanRecord) -> list[SpanRecord]:
    """Depth-first from the root, children by start time; orphans appended."""
    children: dict[str | None, list[SpanRecord]] = defaultdict(list)
    for s in spans:
        children[s.parent_id].append(s)
    out: list[SpanRecord] = []

    def visit(s: SpanRecord) -> None:
        out.append(s)
        for c in sorted(children[s.span_id], key=lambda c: c.start_ns):
            visit(c)

    visit(root)
    seen = {s.span_id for s in out}
    return out + [s for s in spans if s.span_id not in seen]
