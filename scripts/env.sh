#!/usr/bin/env bash
# Sourced by demo.sh and test.sh: create or reuse the venv, install the pinned requirements and
# build commpress into it. Idempotent; a fresh machine needs nothing but python3 (3.11) and g++.
# COMMPRESS_VENV picks another venv folder; COMMPRESS_PURE_PYTHON=1 skips the C++ extension;
# COMMPRESS_REQUIREMENTS=demo installs requirements/demo.txt (demo.sh), else dev.txt (all of CI's).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${COMMPRESS_VENV:-$ROOT/.venv}
PYTHON_BIN=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  echo "[commpress] creating venv in $VENV" >&2
  "$PYTHON_BIN" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# Requirements are re-installed only when the list changed (one stamp per list = its hash); the
# demo list is a subset of dev.txt, so a venv with the current dev list needs nothing for the demo.
REQS=${COMMPRESS_REQUIREMENTS:-dev}
case "$REQS" in dev|demo) ;; *) echo "[commpress] COMMPRESS_REQUIREMENTS must be dev or demo, got $REQS" >&2; exit 2;; esac
hash_of() { cat "$ROOT/requirements/$1.txt" "$ROOT/requirements/runtime.txt" | sha256sum | cut -d' ' -f1; }
stamp_ok() { [ "$(cat "$VENV/.commpress-requirements-$1" 2>/dev/null)" = "$(hash_of "$1")" ]; }
if ! stamp_ok "$REQS" && ! stamp_ok dev; then
  echo "[commpress] installing pinned requirements/$REQS.txt (torch==2.13.0 CPU, ...)" >&2
  "${PIP[@]}" install -r "$ROOT/requirements/$REQS.txt" 2> >(grep -v "^WARNING: Location" >&2)
  hash_of "$REQS" > "$VENV/.commpress-requirements-$REQS"
fi
# The native build says what it does: setup.py's "[commpress setup]" lines and one line per
# compiled file (ninja's [n/total]); the full output goes to $VENV/build.log.
echo "[commpress] building the extension (pip install --no-build-isolation -e .; log: $VENV/build.log)" >&2
build_start=$(date +%s)
# (-v without -q: pip shows the build's output only at verbosity 1)
if ! "$VENV/bin/python" -m pip --disable-pip-version-check install -v --no-build-isolation --no-deps -e "$ROOT" 2>&1 | tee "$VENV/build.log" | awk '
    /^ *\[commpress setup\]/ { sub(/^ */, ""); print; fflush(); next }
    /^ *\[[0-9]+\/[0-9]+\] / {
      src = ""; n = split($0, a, " ")
      for (i = 1; i < n; i++) if (a[i] == "-c" && a[i + 1] !~ /^-/) src = a[i + 1]
      sub(/.*\/csrc\//, "csrc/", src)
      print "[commpress setup] " a[1] " " src; fflush()
    }' >&2; then
  tail -40 "$VENV/build.log" >&2
  echo "[commpress] build failed (full log: $VENV/build.log)" >&2
  exit 1
fi
echo "[commpress] installed in $(( $(date +%s) - build_start )) s" >&2
export PATH="$VENV/bin:$PATH"
PY="$VENV/bin/python"
