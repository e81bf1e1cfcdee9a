#!/usr/bin/env bash
# Sourced by demo.sh and test.sh: create or reuse the venv, install the pinned requirements and
# build commpress into it. Idempotent; a fresh machine needs nothing but python3 (3.11) and g++.
# COMMPRESS_VENV picks another venv folder; COMMPRESS_PURE_PYTHON=1 skips the C++ extension.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${COMMPRESS_VENV:-$ROOT/.venv}
PYTHON_BIN=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  echo "[commpress] creating venv in $VENV" >&2
  "$PYTHON_BIN" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# Requirements are re-installed only when the file changed (stamp = its hash).
stamp="$VENV/.commpress-requirements"
want=$(sha256sum "$ROOT/requirements/dev.txt" | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[commpress] installing pinned requirements (torch==2.13.0 CPU, numba, pytest, ...)" >&2
  "${PIP[@]}" install -r "$ROOT/requirements/dev.txt" 2> >(grep -v "^WARNING: Location" >&2)
  echo "$want" > "$stamp"
fi
echo "[commpress] building the extension (pip install --no-build-isolation -e .)" >&2
"${PIP[@]}" install --no-build-isolation --no-deps -e "$ROOT" 2> >(grep -v "^WARNING: Location" >&2)
export PATH="$VENV/bin:$PATH"
PY="$VENV/bin/python"
