"""Speed of the int8/int4 codec: the fast path against its pure-torch specification.

    python scripts/bench_blockint.py [--numel 4194304] [--threads 1]

The fast path is the native kernels where built (else vectorised torch; ``COMMPRESS_DISABLE_NATIVE=1``
times that). Against ``copy_`` through the codec API: ``scripts/bench_encode_api.py --codec int8 --decode``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from commpress.kernels import blockint as fast
from commpress.spec import blockint as spec


def best_ms(f: Callable[[], object], repeat: int = 5) -> float:
    f()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=1 << 22)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--block", type=int, default=spec.DEFAULT_BLOCK)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    x = torch.randn(args.numel)
    out = torch.empty_like(x)
    print(f"{args.numel} float32, block {args.block}, {args.threads} thread(s), torch {torch.__version__}")
    for bits in (8, 4):
        s, f = spec.encode_reference(x, bits, args.block)
        enc_ref = best_ms(lambda: spec.encode_reference(x, bits, args.block))
        enc_fast = best_ms(lambda: fast.encode(x, bits, args.block))
        dec_ref = best_ms(lambda: spec.decode_reference(s, f, bits, args.block, out))
        dec_fast = best_ms(lambda: fast.decode(s, f, bits, args.block, out))
        print(f"int{bits}: encode reference {enc_ref:.1f} ms, fast {enc_fast:.1f} ms; "
              f"decode reference {dec_ref:.1f} ms, fast {dec_fast:.1f} ms")


if __name__ == "__main__":
    main()
