#!/usr/bin/env bash
# The README's test command: the default (fast) stage. `-m slow` runs the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] && . .venv/bin/activate
export GLOO_SOCKET_IFNAME=lo UCX_NET_DEVICES=lo
exec python -m pytest -q -p no:cacheprovider "$@"
