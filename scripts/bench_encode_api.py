"""Encode through the codec API against ``copy_``, in elements per second, side by side.

    python scripts/bench_encode_api.py                      # QSGD 4-bit, 16M float32, 1 thread
    python scripts/bench_encode_api.py --codec sign --size 64M --rounds 5
    python scripts/bench_encode_api.py --codec int8 --decode   # also time codec.decode(packet, out)
    python scripts/bench_encode_api.py --codec sign --profile  # + one read of x, output allocation

Issue #14's target: QSGD 4-bit ``codec.encode(x)`` at >= 0.7x ``copy_``'s elements/s (16M, 1
thread). Each round times ``y.copy_(x)`` and ``codec.encode(x)`` (median of ``--reps``) one after
the other, so load on a shared machine hits both alike; the ratio is what to compare. With
``--decode`` each round also times ``codec.decode(packet, out)`` into a preallocated ``out``
(issue #25's int8/int4 target: encode and decode at >= 0.7x ``copy_``, 16M float32, 1 thread).
The last lines give the median and range of the rounds' ratios (on a shared machine, report both).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import commpress.codecs as codecs

SIZES = {"256K": 1 << 18, "1M": 1 << 20, "16M": 1 << 24, "64M": 1 << 26}


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
    ap.add_argument("--profile", action="store_true",
                    help="also time one read of x (x.sum()) and allocating the packet's sections, vs copy_")
    args = ap.parse_args()
    if args.rounds < 1 or args.reps < 1 or args.threads < 1:
        ap.error("--rounds, --reps and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    codec = codecs.from_spec(args.codec) if ":" in args.codec else codecs.get(args.codec)
    x = torch.randn(SIZES[args.size], generator=torch.Generator().manual_seed(0))
    y = torch.empty_like(x)
    packet = codec.encode(x, seed=1)
    print(f"{codec!r}, {args.size} float32, {args.threads} thread(s), median of {args.reps} per round")
    ratios: dict[str, list[float]] = {"encode": [], "decode": [], "x.sum()": [], "allocate": []}
    shapes = [(t.numel(), t.dtype) for t in packet.sections.values()]
    for r in range(args.rounds):
        copy_s = median_s(lambda: y.copy_(x), args.reps)
        encode_s = median_s(lambda: codec.encode(x, seed=1), args.reps)
        line = (f"round {r}: copy_ {copy_s * 1e3:.2f} ms, encode {encode_s * 1e3:.2f} ms, "
                f"encode at {copy_s / encode_s:.2f}x copy_'s elements/s")
        ratios["encode"].append(copy_s / encode_s)
        if args.decode:
            decode_s = median_s(lambda: codec.decode(packet, y), args.reps)
            line += f"; decode {decode_s * 1e3:.2f} ms, at {copy_s / decode_s:.2f}x"
            ratios["decode"].append(copy_s / decode_s)
        if args.profile:  # what bounds an encode: one read of x from memory; allocating its outputs
            sum_s = median_s(lambda: x.sum(), args.reps)
            alloc_s = median_s(lambda: [torch.empty(n, dtype=d) for n, d in shapes], args.reps)
            line += f"; x.sum() {sum_s * 1e3:.2f} ms, allocating the sections {alloc_s * 1e3:.3f} ms"
            ratios["x.sum()"].append(copy_s / sum_s)
            ratios["allocate"].append(copy_s / alloc_s)
        print(line, flush=True)
    for what, values in ratios.items():
        if values:  # the rounds' spread says how loaded the machine was
            print(f"{what}: median {statistics.median(values):.2f}x copy_'s elements/s over {len(values)} rounds "
                  f"(range {min(values):.2f}-{max(values):.2f}x)")


if __name__ == "__main__":
    main()
