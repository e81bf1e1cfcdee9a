"""Time native vs reference bit packing next to a plain copy_ of the same bytes.

    python scripts/bench_bitpack.py [--n 16777216] [--bits 1 4] [--device cpu|cuda]

GB/s counts the bytes each operation reads plus the bytes it writes, so the copy_ row (read n,
write n) is the memory-bandwidth ceiling the kernels are measured against.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch.utils.benchmark import Timer

from commpress.bitpack import pack_bits_reference, packed_nbytes, unpack_bits_reference
from commpress.kernels import ops


def median_seconds(fn: Callable[[], object], min_run_time: float) -> float:
    # Timer synchronises CUDA around each measurement.
    return (
        Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16 * 2**20, help="number of fields")
    parser.add_argument("--bits", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--min-run-time", type=float, default=1.0, help="seconds per row")
    args = parser.parse_args()

    reason = ops.load_native()
    native = {
        "pack": ops.has_native("pack_bits", args.device),
        "unpack": ops.has_native("unpack_bits", args.device),
    }
    print(f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}")
    print(f"native extension: {'loaded' if reason is None else reason}; kernels here: {native}")
    print(f"{'op':<28} {'ms':>9} {'GB/s':>8}")

    n = args.n
    dst = torch.empty(n, dtype=torch.uint8, device=args.device)
    for bits in args.bits:
        fields = torch.randint(0, 1 << bits, (n,), dtype=torch.uint8, device=args.device)
        packed = pack_bits_reference(fields, bits)
        moved = n + packed_nbytes(n, bits)  # read + write, both directions
        rows: list[tuple[str, Callable[[], object], int]] = [
            (f"copy_ {n} B", lambda: dst.copy_(fields), 2 * n),
            (f"reference pack bits={bits}", lambda: pack_bits_reference(fields, bits), moved),
            (
                f"reference unpack bits={bits}",
                lambda: unpack_bits_reference(packed, bits, n),
                moved,
            ),
        ]
        if native["pack"]:
            rows.append(
                (
                    f"native pack bits={bits}",
                    lambda: torch.ops.commpress.pack_bits.default(fields, bits),
                    moved,
                )
            )
        if native["unpack"]:
            rows.append(
                (
                    f"native unpack bits={bits}",
                    lambda: torch.ops.commpress.unpack_bits.default(packed, bits, n),
                    moved,
                )
            )
        for name, fn, nbytes in rows:
            seconds = median_seconds(fn, args.min_run_time)
            print(f"{name:<28} {seconds * 1e3:>9.3f} {nbytes / seconds / 1e9:>8.2f}")


if __name__ == "__main__":
    main()
