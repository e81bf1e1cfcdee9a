"""Encode through the codec API against ``copy_``, in elements per second, side by side.

    python scripts/bench_encode_api.py                      # QSGD 4-bit, 16M float32, 1 thread
    python scripts/bench_encode_api.py --codec sign --size 64M --rounds 5
    python scripts/bench_encode_api.py --codec int8 --decode   # also time codec.decode(packet, out)

Issue #14's target: QSGD 4-bit ``codec.encode(x)`` at >= 0.7x ``copy_``'s elements/s (16M, 1
thread). Each round times ``y.copy_(x)`` and ``codec.encode(x)`` (median of ``--reps``) one after
the other, so load on a shared machine hits both alike; the ratio is what to compare. With
``--decode`` each round also times ``codec.decode(packet, out)`` into a preallocated ``out``
(issue #25's int8/int4 target: encode and decode at >= 0.7x ``copy_``, 16M float32, 1 thread).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import commpress.codecs as codecs

SIZES = {"1M": 1 << 20, "16M": 1 << 24, "64M": 1 << 26}


def median_s(fn: Callable[[], object], reps: int) -> float:
    """Median wall-clock seconds of ``reps`` calls."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--codec", default="qsgd", help="a codec spec, e.g. qsgd, qsgd:bits=8, sign, topk:ratio=0.01")
    ap.add_argument("--size", choices=sorted(SIZES), default="16M")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--decode", action="store_true", help="also time codec.decode(packet, out)")
    args = ap.parse_args()
    if args.rounds < 1 or args.reps < 1 or args.threads < 1:
        ap.error("--rounds, --reps and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    codec = codecs.from_spec(args.codec) if ":" in args.codec else codecs.get(args.codec)
    x = torch.randn(SIZES[args.size], generator=torch.Generator().manual_seed(0))
    y = torch.empty_like(x)
    packet = codec.encode(x, seed=1)
    print(f"{codec!r}, {args.size} float32, {args.threads} thread(s), median of {args.reps} per round")
    for r in range(args.rounds):
        copy_s = median_s(lambda: y.copy_(x), args.reps)
        encode_s = median_s(lambda: codec.encode(x, seed=1), args.reps)
        line = (f"round {r}: copy_ {copy_s * 1e3:.2f} ms, encode {encode_s * 1e3:.2f} ms, "
                f"encode at {copy_s / encode_s:.2f}x copy_'s elements/s")
        if args.decode:
            decode_s = median_s(lambda: codec.decode(packet, y), args.reps)
            line += f"; decode {decode_s * 1e3:.2f} ms, at {copy_s / decode_s:.2f}x"
        print(line, flush=True)


if __name__ == "__main__":
    main()
