"""No code-running deserialization in the source: pickle and friends, torch.load without
weights_only=True, numpy allow_pickle, unsafe YAML, and pickle checkpoints (`*.bin`, use_safetensors=False).

Checked statically over every Python file of the project (tests and .venv aside). Exit status 1
with one line per finding. ALLOWED lists the known exceptions, each with the reason it is there;
a new finding fails until it is removed or argued for here.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {".venv", "build", "tests", "__pycache__", ".git", "dist", "node_modules"}
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
UNSAFE_YAML = {"load", "load_all", "unsafe_load", "unsafe_load_all", "full_load", "full_load_all"}
ALLOWED: set[tuple[str, str]] = {
}


def _keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _dotted(node) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def findings(source: str, name: str = "<source>") -> list[tuple[int, str, str]]:
    """(line, rule, message) for each unsafe construct in `source`."""
    out = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for module in modules:
                if module.split(".")[0] in PICKLE_MODULES:
                    out.append((node.lineno, "pickle", f"imports {module} (deserializing it runs code)"))
        elif isinstance(node, ast.Call):
            func = _dotted(node.func)
            if func.endswith("torch.load"):
                if not _is_true(_keyword(node, "weights_only")):
                    out.append((node.lineno, "torch.load", "torch.load without weights_only=True unpickles"))
            elif func in ("np.load", "numpy.load") and _is_true(_keyword(node, "allow_pickle")):
                out.append((node.lineno, "allow_pickle", f"{func}(allow_pickle=True) unpickles"))
            elif func.startswith("yaml.") and func.split(".", 1)[1] in UNSAFE_YAML:
                loader = _dotted(_keyword(node, "Loader")) if _keyword(node, "Loader") is not None else ""
                if not loader.endswith("SafeLoader"):
                    out.append((node.lineno, "yaml", f"{func} without SafeLoader builds arbitrary objects"))
            use_safetensors = _keyword(node, "use_safetensors")
            if isinstance(use_safetensors, ast.Constant) and use_safetensors.value is False:
                out.append((node.lineno, "bin-weights", "use_safetensors=False loads pickle checkpoints"))
            if "load" in func.rsplit(".", 1)[-1].lower():
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.endswith(PICKLE_SUFFIXES):
                        out.append((node.lineno, "bin-weights", f"{func}({arg.value!r}) loads a pickle checkpoint"))
    return out


def problems(root: Path = ROOT) -> list[str]:
    found = []
    for file in sorted(root.rglob("*.py")):
        rel = file.relative_to(root)
        if SKIP_DIRS & set(rel.parts) or file.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        for line, rule, message in findings(file.read_text(), str(rel)):
            if (str(rel), rule) not in ALLOWED:
                found.append(f"{rel}:{line}: {message}")
    return found


def main() -> int:
    found = problems()
    for line in found:
        print(line)
    if not found:
        print("no pickle: ok")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
