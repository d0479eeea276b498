#!/usr/bin/env bash
# Installs splitserve and its test tools into ./.venv (idempotent, offline-friendly).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first and pinned: the CPU build on disk; an open range would pull CUDA wheels.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev,nixl]"
