"""Kernel benchmark; the code lives in commpress/bench_kernels.py (also `commpress bench`)."""

import sys

from commpress.bench_kernels import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
