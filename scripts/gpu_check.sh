#!/usr/bin/env bash
# Build commpress with its CUDA kernels and check them on this machine's NVIDIA GPU, in one go:
#   1. build the extension (CPU + CUDA kernels) in a scratch copy of the checkout, for this
#      GPU's architecture only (TORCH_CUDA_ARCH_LIST; a couple of minutes at most);
#   2. pytest tests/kernels/test_native.py tests/kernels/test_kernels.py tests/kernels/test_cupy.py tests/kernels/test_blockint_kernels.py
#      tests/kernels/test_blockint_sr.py tests/kernels/test_blockint_sr_cuda.py: every CUDA kernel
#      against the pure-torch reference, bit for bit, opcheck, bad input -- on the native build
#      and on the CuPy backend (the same sources through NVRTC) when CuPy is installed;
#   3. scripts/bench_kernels.py --device cuda: the kernel benchmark and its targets, for every
#      backend that runs (native, cupy).
# Results (test log, benchmark table as text and markdown, versions) go to $OUT_DIR
# (default: out/gpu-check/ in the checkout). A few minutes on an H100/H200.
#
# Needs: an NVIDIA driver (nvidia-smi), a CUDA toolkit of torch's CUDA major version (found as
# setup.py finds it: $CUDA_HOME, nvcc on PATH even behind a wrapper script, /usr/local/cuda*),
# Python >= 3.11 with a CUDA build of torch; numpy, pytest, pytest-timeout, hypothesis,
# setuptools, wheel and ninja are installed into it when missing. The pinned CPU torch
# of requirements/dev.txt cannot compile CUDA code, so the script looks for a CUDA torch in
# $PYTHON, then the checkout's .venv, then python3, and stops with instructions if none has one.
#
#   bash scripts/gpu_check.sh                    # everything
#   SKIP_BENCH=1 bash scripts/gpu_check.sh       # build + tests only
#   BENCH_ARGS="--sizes 1M 16M" bash scripts/gpu_check.sh
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT_DIR=${OUT_DIR:-$ROOT/out/gpu-check}
mkdir -p "$OUT_DIR"
log() { echo "[gpu_check] $*" >&2; }

# ----- the GPU -----------------------------------------------------------------------------------
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  log "no NVIDIA GPU visible (nvidia-smi failed); this script needs one"
  exit 2
fi

# ----- a Python with a CUDA build of torch -----------------------------------------------------
PY=""
for candidate in "${PYTHON:-}" "$ROOT/.venv/bin/python" python3 python; do
  [ -n "$candidate" ] || continue
  command -v "$candidate" >/dev/null 2>&1 || continue
  if "$candidate" -c 'import sys, torch; sys.exit(0 if torch.version.cuda and torch.cuda.is_available() else 1)' 2>/dev/null; then
    PY=$(command -v "$candidate")
    break
  fi
done
if [ -z "$PY" ]; then
  log "no Python here has a CUDA build of torch that sees the GPU."
  log "install one matching your driver and CUDA toolkit (nvcc --version), e.g."
  log "    python3 -m venv ~/cp-gpu && ~/cp-gpu/bin/pip install torch --index-url https://download.pytorch.org/whl/cu128"
  log "    ~/cp-gpu/bin/pip install numpy pytest hypothesis setuptools wheel ninja"
  log "then run:  PYTHON=~/cp-gpu/bin/python bash scripts/gpu_check.sh"
  exit 2
fi
# What the build and the tests need (pyproject.toml's pytest options use pytest-timeout).
missing=$("$PY" - <<'EOF'
import importlib.util
need = {"numpy": "numpy", "pytest": "pytest", "pytest_timeout": "pytest-timeout", "hypothesis": "hypothesis",
        "setuptools": "setuptools>=69", "wheel": "wheel", "ninja": "ninja"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
EOF
)
if [ -n "$missing" ]; then
  log "installing missing build/test dependencies into $PY: $missing"
  # shellcheck disable=SC2086
  "$PY" -m pip install -q $missing || { log "could not install $missing; install them and rerun"; exit 2; }
fi

# ----- the CUDA toolkit: the one setup.py will build with --------------------------------------
# setup.py looks at $CUDA_HOME, $CUDA_PATH, nvcc on PATH (its real folder, seen through wrapper
# scripts), /usr/local/cuda*, and takes the first with include/cuda_runtime.h and an nvcc of
# torch's CUDA major version; it says which one and why the others would not do.
CUDA_MAJOR=$("$PY" -c 'import torch; print(torch.version.cuda.split(".")[0])')
if ! CUDA_HOME=$(cd "$ROOT" && "$PY" setup.py --cuda-home); then
  log "no CUDA $CUDA_MAJOR.x toolkit with include/cuda_runtime.h found (above); set CUDA_HOME to one"
  exit 2
fi
export CUDA_HOME
export PATH="$CUDA_HOME/bin:$PATH"

# CuPy (optional): the wheel for torch's CUDA major version, and NVRTC to compile with (CUDA 13
# ships it as nvidia-cuda-nvrtc, CUDA 12 as nvidia-cuda-nvrtc-cu12)
if ! "$PY" -c 'import cupy' 2>/dev/null; then
  if [ "$CUDA_MAJOR" -ge 13 ]; then NVRTC="nvidia-cuda-nvrtc>=${CUDA_MAJOR},<$((CUDA_MAJOR + 1))"; else NVRTC="nvidia-cuda-nvrtc-cu${CUDA_MAJOR}"; fi
  log "installing cupy-cuda${CUDA_MAJOR}x and $NVRTC for the CuPy backend (skipped if that fails)"
  "$PY" -m pip install -q "cupy-cuda${CUDA_MAJOR}x" "$NVRTC" \
    || "$PY" -m pip install -q "cupy-cuda${CUDA_MAJOR}x" \
    || log "could not install CuPy: its backend tests will be skipped"
fi

ARCH=$("$PY" -c 'import torch; m, n = torch.cuda.get_device_capability(); print(f"{m}.{n}")')
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$ARCH}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$ROOT" diff --quiet 2>/dev/null || echo ' (+ local changes)')"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  echo "CUDA toolkit: $CUDA_HOME ($(nvcc --version | tail -1))"
  "$PY" -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda})")'
  echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
} | tee "$OUT_DIR/versions.txt" >&2

# ----- build in a scratch copy (the checkout's own CPU build stays untouched) ------------------
WORK=$(mktemp -d "${TMPDIR:-/tmp}/commpress-gpu.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git -C "$ROOT" ls-files -co --exclude-standard -z | (cd "$ROOT" && tar --null -T - -cf -) | tar -C "$WORK" -xf -
else
  tar -C "$ROOT" --exclude=.venv --exclude=build --exclude='*.so' -cf - . | tar -C "$WORK" -xf -
fi
log "building the extension with CUDA kernels for sm_${ARCH/./} in $WORK"
start=$(date +%s)
(cd "$WORK" && "$PY" setup.py build_ext --inplace >"$OUT_DIR/build.log" 2>&1) || {
  tail -40 "$OUT_DIR/build.log" >&2
  log "build failed (full log: $OUT_DIR/build.log)"
  exit 1
}
grep -E '^ *\[commpress setup\]' "$OUT_DIR/build.log" | sed 's/^ *//' >&2 || true
log "built in $(( $(date +%s) - start )) s"
export PYTHONPATH="$WORK${PYTHONPATH:+:$PYTHONPATH}"
(cd "$WORK" && "$PY" -c 'import commpress.kernels.ops as o, torch
assert o.load_native() is None, o.load_native()
missing = [op for op, devs in o.native_ops().items() if "cuda" not in devs]
assert not missing, f"no CUDA kernel for {missing}"
print("native ops:", o.native_ops())') >&2

# ----- tests -----------------------------------------------------------------------------------
status=0
log "pytest tests/kernels/test_native.py tests/kernels/test_kernels.py tests/kernels/test_cupy.py tests/kernels/test_blockint_kernels.py tests/kernels/test_blockint_sr.py tests/kernels/test_blockint_sr_cuda.py"
(cd "$WORK" && HYPOTHESIS_PROFILE=ci "$PY" -m pytest -q -p no:cacheprovider -rs \
  tests/kernels/test_native.py tests/kernels/test_kernels.py tests/kernels/test_cupy.py tests/kernels/test_blockint_kernels.py \
  tests/kernels/test_blockint_sr.py tests/kernels/test_blockint_sr_cuda.py 2>&1) | tee "$OUT_DIR/tests.log" >&2 || status=1

# ----- benchmark -------------------------------------------------------------------------------
if [ -z "${SKIP_BENCH:-}" ]; then
  log "scripts/bench_kernels.py --device cuda ${BENCH_ARGS:-}"
  # shellcheck disable=SC2086
  (cd "$WORK" && "$PY" scripts/bench_kernels.py --device cuda --markdown "$OUT_DIR/bench_cuda.md" \
    ${BENCH_ARGS:-} 2>&1) | tee "$OUT_DIR/bench_cuda.txt" >&2 || status=1
fi
log "results in $OUT_DIR ($( [ $status -eq 0 ] && echo 'all passed' || echo 'FAILURES, see the logs'))"
exit $status
