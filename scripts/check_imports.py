"""Import rules (DESIGN.md), checked statically and by really importing.

    kernels ← engine ← {prefill_worker, decode_worker}     (one direction)
    prefill_worker and decode_worker never import each other
    router, control_plane, gateway, client, proto never import torch —
    not directly, and not through anything they import.

Exit status 1 with one line per violation.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIGHT = ["router", "control_plane", "gateway", "client", "proto"]
# package -> packages it must not import
FORBIDDEN = {
    "kernels": {"engine", "prefill_worker", "decode_worker", "router", "control_plane", "gateway", "client"},
    "engine": {"prefill_worker", "decode_worker", "router", "control_plane", "gateway", "client"},
    "prefill_worker": {"decode_worker", "router", "gateway", "client"},
    "decode_worker": {"prefill_worker", "router", "gateway", "client"},
    "control_plane": {"engine", "kernels", "prefill_worker", "decode_worker", "router", "gateway", "client"},
    "router": {"kernels", "prefill_worker", "decode_worker", "gateway"},
    "gateway": {"kernels", "engine", "prefill_worker", "decode_worker"},
    "client": {"kernels", "engine", "prefill_worker", "decode_worker", "router", "gateway"},
    "proto": {"kernels", "engine", "prefill_worker", "decode_worker", "router", "control_plane", "gateway", "client"},
}
# torch-free engine modules the light packages may share (the router hashes like the engines do;
# the gateway and the SDK tokenize like they do, and find the embedded model's tokenizer).
SHARED_ENGINE_MODULES = {
    "splitserve.engine.block_hash",
    "splitserve.engine.kv_events",
    "splitserve.engine.tokenizer",
    "splitserve.engine.default_model",
    "splitserve.engine.logit_adjustments",
    "splitserve.engine.guided",
}
# The worker-process code both workers share lives in engine/ (they may not import each
# other) and registers with the control plane, as workers do.
WORKER_SHARED = {"engine/worker_server.py"}


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def static_violations() -> list[str]:
    problems = []
    for package, banned in FORBIDDEN.items():
        for file in sorted((ROOT / package).rglob("*.py")):
            if file.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            for line, module in _imports(file):
                parts = module.split(".")
                rel = file.relative_to(ROOT)
                if package in LIGHT and parts[0] == "torch":
                    problems.append(f"{rel}:{line}: imports torch (light processes must not)")
                if parts[0] == "splitserve" and len(parts) > 1 and parts[1] in banned:
                    if module in SHARED_ENGINE_MODULES:
                        continue
                    if str(rel) in WORKER_SHARED and parts[1] == "control_plane":
                        continue
                    problems.append(f"{rel}:{line}: {package} must not import {module}")
    return problems


def dynamic_violations() -> list[str]:
    """Import every module of the light packages in a clean interpreter; torch must stay out."""
    modules = []
    for package in LIGHT:
        for file in sorted((ROOT / package).rglob("*.py")):
            rel = file.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if parts[-1] in ("__main__", "generate"):
                continue  # entry scripts run code on import
            modules.append("splitserve." + ".".join(parts))
    code = (
        "import importlib, sys\n"
        f"mods = {modules!r}\n"
        "bad = []\n"
        "for m in mods:\n"
        "    importlib.import_module(m)\n"
        "    if 'torch' in sys.modules:\n"
        "        bad.append(m); break\n"
        "print('\\n'.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    if out.returncode:
        return [f"importing the light packages failed:\n{out.stderr.strip()}"]
    return [f"{m}: importing it loads torch" for m in out.stdout.split() if m]


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from check_no_pickle import problems as unsafe_deserialization  # no pickle anywhere (same CI step)

    problems = static_violations() + dynamic_violations() + unsafe_deserialization(ROOT)
    for p in problems:
        print(p)
    if not problems:
        print("import rules: ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
