#!/usr/bin/env bash
# The README's main-job command: set up from scratch, then compress the gradients of a small
# byte-level transformer trained on Python's own standard-library sources with every codec
# and print a table. Extra arguments go to scripts/demo_codecs.py (see --help).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec "$PY" scripts/demo_codecs.py "$@"
