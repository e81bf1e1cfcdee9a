#!/usr/bin/env bash
# The README's main-job command: set up from scratch, then train a byte-level language model on
# Python's standard-library sources with 2 local workers, dense vs the commpress top-k hook,
# with progress bars, a closing table and a saved plot (out/train_demo.png).
# Extra arguments go to `python -m commpress train` (see --help), e.g. --codec sign --param block_size=256.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec "$PY" -m commpress train "$@"
