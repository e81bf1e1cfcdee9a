#!/usr/bin/env bash
# Prove the CUDA build path without a GPU: compile and link commpress._C with its CUDA kernels
# against a CUDA build of torch, install the wheel, and check that `python -m commpress info`
# lists a CUDA kernel for every op (registration only: nothing runs on a GPU).
#
# Run it before every change to csrc/cuda, csrc/registration.cpp or setup.py (CI does not: the
# CUDA torch is a multi-GB install and the build alone takes minutes on 2 cores; see docs/install.md,
# "CUDA"). Needs a CUDA toolkit whose major version matches the CUDA torch's (nvcc 13.x for
# the default torch); setup.py finds it by itself (CUDA_HOME, nvcc on PATH, /usr/local/cuda*).
#
#   bash scripts/cuda_build_check.sh
#   CUDA_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130" bash scripts/cuda_build_check.sh
#
# Environment:
#   CUDA_CHECK_VENV       venv holding the CUDA torch, created once and reused
#                         (default ~/.cache/commpress/cuda-check-venv; several GB: rm -r it to free)
#   CUDA_TORCH            pip arguments for the CUDA torch (default torch==2.14.1, a CUDA 13.0 build)
#   TORCH_CUDA_ARCH_LIST  architectures to compile for (default 9.0: one is enough to prove the build)
#   MAX_JOBS              parallel compiles (default: all cores)
#   OUT_DIR               logs (default out/cuda-build-check/ in the checkout)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${CUDA_CHECK_VENV:-$HOME/.cache/commpress/cuda-check-venv}
CUDA_TORCH=${CUDA_TORCH:-torch==2.14.1}
OUT_DIR=${OUT_DIR:-$ROOT/out/cuda-build-check}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
mkdir -p "$OUT_DIR"
log() { echo "[cuda_build_check] $*" >&2; }
start_all=$(date +%s)

# ----- a venv with a CUDA build of torch ---------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
  log "installing a CUDA build of torch ($CUDA_TORCH): several GB, once"
  # shellcheck disable=SC2086
  "$PY" -m pip install -q $CUDA_TORCH
fi
"$PY" -m pip install -q numpy "setuptools>=69" wheel ninja
TORCH_INFO=$("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda or "")')
read -r TORCH_VERSION TORCH_CUDA <<<"$TORCH_INFO"
if [ -z "$TORCH_CUDA" ]; then
  log "torch $TORCH_VERSION in $VENV is not a CUDA build; remove $VENV or set CUDA_TORCH"
  exit 2
fi
log "torch $TORCH_VERSION (CUDA $TORCH_CUDA), TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS"

# ----- the toolkit, as setup.py will choose it ---------------------------------------------------
if ! CUDA_TOOLKIT=$(cd "$ROOT" && "$PY" setup.py --cuda-home); then
  log "no CUDA $TORCH_CUDA toolkit found (see above); set CUDA_HOME or install one"
  exit 2
fi
log "toolkit: $CUDA_TOOLKIT"

# ----- build a wheel from a scratch copy of the checkout, install it -----------------------------
WORK=$(mktemp -d "${TMPDIR:-/tmp}/commpress-cuda-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git -C "$ROOT" ls-files -co --exclude-standard -z | (cd "$ROOT" && tar --null -T - -cf -) | tar -C "$WORK" -xf -
else
  tar -C "$ROOT" --exclude=.venv --exclude=build --exclude='*.so' -cf - . | tar -C "$WORK" -xf -
fi
rm -f "$WORK"/commpress/_C*.so
log "building the wheel (compile + link; full log: $OUT_DIR/build.log)"
start=$(date +%s)
if ! (cd "$WORK" && COMMPRESS_NATIVE=1 COMMPRESS_REQUIRE_CUDA=1 "$PY" -m pip wheel -v --no-build-isolation \
      --no-deps -w "$WORK/dist" . >"$OUT_DIR/build.log" 2>&1); then
  tail -40 "$OUT_DIR/build.log" >&2
  log "build failed (full log: $OUT_DIR/build.log)"
  exit 1
fi
build_s=$(( $(date +%s) - start ))
grep -E '^ *\[commpress setup\]' "$OUT_DIR/build.log" | sed 's/^ *//' >&2 || true
WHEEL=$(ls "$WORK"/dist/commpress-*.whl)
log "built $(basename "$WHEEL") in $build_s s"
"$PY" -m pip install -q --no-deps --force-reinstall "$WHEEL"

# ----- the installed package lists CUDA kernels for every op -------------------------------------
# Run from an empty folder so `import commpress` finds the installed wheel, not a checkout.
(cd "$WORK/dist" && "$PY" -m commpress info) | tee "$OUT_DIR/info.txt" >&2
(cd "$WORK/dist" && "$PY" -m commpress info --json) >"$OUT_DIR/info.json"
"$PY" - "$OUT_DIR/info.json" <<'EOF'
import json
import sys

report = json.load(open(sys.argv[1], encoding="utf-8"))
native = report["native"]
assert native["loaded"], f"commpress._C did not load: {native['reason']}"
missing = [op for op, devices in native["ops"].items() if "cuda" not in devices]
assert not missing, f"no CUDA kernel registered for {missing}"
print(f"[cuda_build_check] CUDA kernels registered for all {len(native['ops'])} ops", file=sys.stderr)
EOF
log "passed in $(( $(date +%s) - start_all )) s (build $build_s s); logs in $OUT_DIR"
