#!/usr/bin/env bash
# The README's test command: set up from scratch (venv, pinned deps, build), lint, type-check, test.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k wire -x`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
echo "[commpress] ruff" >&2
"$PY" -m ruff check commpress tests scripts examples setup.py
echo "[commpress] mypy" >&2
"$PY" -m mypy
echo "[commpress] pytest" >&2
"$PY" -m commpress info
exec "$PY" -m pytest -q --durations=20 "$@"
