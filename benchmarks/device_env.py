"""Unpack the wheels carried in `.whl/` for a bare GPU host (no pip index there).

    python3 benchmarks/device_env.py            # -> /tmp/site; then PYTHONPATH=/tmp/site

The lent H200 image has torch, triton, transformers, grpcio and protobuf but not
NIXL, pyzmq, OpenTelemetry or aetcd, which the workers import. Fetch them here
with `pip download --no-deps --python-version 3.12 --only-binary=:all: ...` (the worker tests also need
`grpcio-health-checking` — 1.60.1's generated code loads with any protobuf runtime there — and
`opentelemetry-semantic-conventions` matching the SDK; the lent H100 image had grpcio 1.84,
older than our generated stubs need: carry `grpcio==1.85.1` for `--platform manylinux2014_x86_64`)
(and `../shared/tools/offline-gpu-wheels.sh` for a trimmed nixl-cu13), carry
`.whl/` (64 MiB per call), and unpack with zipfile (the image has no unzip).
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path


def main() -> None:
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/site")
    target.mkdir(parents=True, exist_ok=True)
    wheels = sorted(Path(".whl").glob("*.whl"))
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(target)
    print(f"unpacked {len(wheels)} wheels into {target}")


if __name__ == "__main__":
    main()
