#!/usr/bin/env bash
# Installs splitserve, its test tools and the system services its tests use
# (Debian etcd-server) into ./.venv. Idempotent; works offline once cached.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v etcd >/dev/null 2>&1; then
  echo "== installing etcd-server (Debian package; the tests start a real etcd)"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq etcd-server >/dev/null \
    || echo "warning: could not install etcd-server; cluster tests will fail" >&2
  # The Debian package starts a system etcd on :2379; the tests run their own.
  ($SUDO systemctl stop etcd 2>/dev/null || $SUDO service etcd stop 2>/dev/null || pkill -x etcd || true) >/dev/null 2>&1
fi
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first and pinned: the CPU build on disk; an open range would pull CUDA wheels.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev,nixl]"
echo "== installed: $(python -c 'import splitserve; print("splitserve", splitserve.__version__)')"
