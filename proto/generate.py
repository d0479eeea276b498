"""Regenerates the Python code of splitserve's gRPC API, or checks it is current.

    python -m splitserve.proto.generate          # rewrite proto/v1/
    python -m splitserve.proto.generate --check  # exit 1 if proto/v1/ is stale (CI)

Sources: ``proto/splitserve/v1/*.proto``, proto package ``splitserve.v1``.
Output: ``proto/v1/`` = the importable package ``splitserve.proto.v1`` with
``<name>_pb2.py``, ``<name>_pb2_grpc.py`` and ``<name>_pb2.pyi`` per file plus
an ``__init__.py``. The whole directory is generated: do not edit it by hand.

Why imports are rewritten: the .proto files import each other as
``splitserve/v1/x.proto``, the path every other language's toolchain (and
grpcurl, reflection) expects, so protoc emits ``from splitserve.v1 import
x_pb2``. Our Python package is ``splitserve.proto.v1`` instead (the top-level
``proto/`` folder is installed as ``splitserve.proto``). Rather than laying the
sources out as ``splitserve/proto/v1/`` — which would change the descriptor
file names every client sees — protoc runs on the canonical layout and the
generator rewrites the ``splitserve.v1`` import lines of its output.

Determinism: protoc (run in-process from ``grpcio-tools``) is deterministic for
one grpcio-tools version, files are written in sorted order with fixed
content. The version is recorded in ``v1/__init__.py``, and ``--check``
names it when it differs from the installed one, since a different
grpcio-tools version changes the output (pin it in the dev dependencies).
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
SOURCE_DIR = PROTO_ROOT / "splitserve" / "v1"
OUTPUT_DIR = PROTO_ROOT / "v1"

# `from splitserve.v1 import x_pb2 as ...` / `import splitserve.v1.x_pb2`
_IMPORT_RE = re.compile(r"^(\s*)(from|import) splitserve\.v1(?=[ .])", re.MULTILINE)
_VERSION_RE = re.compile(r"grpcio-tools (\S+)")
_GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def _tools_version() -> str:
    from importlib.metadata import version

    return version("grpcio-tools")


def _init_text(proto_names: list[str], tools_version: str) -> str:
    modules = "\n".join(f"    splitserve.proto.v1.{name}_pb2(_grpc)" for name in proto_names)
    return (
        '"""Generated gRPC code of the splitserve.v1 API; do not edit.\n'
        "\n"
        f"Written by `python -m splitserve.proto.generate` with grpcio-tools {tools_version}\n"
        "from proto/splitserve/v1/*.proto. Modules:\n"
        "\n"
        f"{modules}\n"
        '"""\n'
    )


def render() -> dict[str, str]:
    """Runs protoc and returns {file name: content} of the output package."""
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit("generating protos needs grpcio-tools: pip install grpcio-tools") from e
    sources = sorted(SOURCE_DIR.glob("*.proto"))
    if not sources:
        raise SystemExit(f"no .proto files in {SOURCE_DIR}")
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory(prefix="splitserve-proto-") as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(str(p.relative_to(PROTO_ROOT)) for p in sources),
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed (see the messages above)")
        generated = Path(tmp) / "splitserve" / "v1"
        files = {
            p.name: _IMPORT_RE.sub(r"\1\2 splitserve.proto.v1", p.read_text())
            for p in sorted(generated.iterdir())
            if p.name.endswith(_GENERATED_SUFFIXES)
        }
    files["__init__.py"] = _init_text([p.stem for p in sources], _tools_version())
    return files


def _existing(directory: Path) -> dict[str, str]:
    if not directory.is_dir():
        return {}
    return {
        p.name: p.read_text()
        for p in sorted(directory.iterdir())
        if p.name == "__init__.py" or p.name.endswith(_GENERATED_SUFFIXES)
    }


def stale_report(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """Lines describing how `actual` differs from `expected`; empty = current."""
    lines = []
    for name in sorted(expected.keys() - actual.keys()):
        lines.append(f"missing: {name}")
    for name in sorted(actual.keys() - expected.keys()):
        lines.append(f"not generated from any .proto (delete it): {name}")
    for name in sorted(expected.keys() & actual.keys()):
        if expected[name] != actual[name]:
            diff = difflib.unified_diff(
                actual[name].splitlines(), expected[name].splitlines(), "committed", "regenerated", n=0, lineterm=""
            )
            first = [line for line in diff if not line.startswith(("---", "+++", "@@"))][:4]
            lines.append(f"differs: {name}: " + " | ".join(first))
    return lines


def write(files: dict[str, str], directory: Path = OUTPUT_DIR) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name in _existing(directory).keys() - files.keys():
        (directory / name).unlink()
    for name in sorted(files):
        path = directory / name
        if not path.exists() or path.read_text() != files[name]:
            path.write_text(files[name])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m splitserve.proto.generate",
        description="Regenerate proto/v1/ (Python gRPC code) from proto/splitserve/v1/*.proto.",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 and list the differences if proto/v1/ is not what generation produces",
    )
    parser.add_argument(
        "--output-dir", type=Path, default=OUTPUT_DIR, help="package directory to write or check (default %(default)s)"
    )
    args = parser.parse_args(argv)
    output_dir: Path = args.output_dir
    expected = render()
    if not args.check:
        write(expected, output_dir)
        print(f"wrote {len(expected)} files to {output_dir}")
        return 0
    actual = _existing(output_dir)
    problems = stale_report(expected, actual)
    if not problems:
        print(f"{output_dir} is up to date")
        return 0
    print(f"{output_dir} is stale: run `python -m splitserve.proto.generate` and commit the result.", file=sys.stderr)
    for line in problems:
        print(f"  {line}", file=sys.stderr)
    committed = _VERSION_RE.search(actual.get("__init__.py", ""))
    installed = _tools_version()
    if committed and committed.group(1) != installed:
        print(
            f"  note: committed code was generated with grpcio-tools {committed.group(1)}, "
            f"installed is {installed}; install that version to compare like with like.",
            file=sys.stderr,
        )
    return 1


if __name__ == "__main__":
    sys.exit(main())
