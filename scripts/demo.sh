#!/usr/bin/env bash
# The README's main-job command: set up from scratch, then train a communication-bound byte-level LM
# (AdamW) on Python's standard-library sources with 2 ranks on emulated 1 Gbit/s links (loopback
# plus a labelled cost-model projection without root): dense vs fp16 vs commpress qsgd, with
# progress bars, a closing table (time to dense's loss x1.02) and a plot (out/train_demo.png).
# Extra arguments go to `python -m commpress train` (see --help), e.g. --codec sign --link 10gbit.
set -euo pipefail
COMMPRESS_REQUIREMENTS=demo source "$(dirname "${BASH_SOURCE[0]}")/env.sh"  # the demo's short list
cd "$ROOT"
exec "$PY" -m commpress train "$@"
