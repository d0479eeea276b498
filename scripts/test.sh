#!/usr/bin/env bash
# The test command of the README: the default (fast) stage.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] && . .venv/bin/activate
exec python -m pytest -q -p no:cacheprovider "$@"
