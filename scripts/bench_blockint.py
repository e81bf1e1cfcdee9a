"""Speed of the int8/int4 codec: the fast path against its pure-torch specification.

    python scripts/bench_blockint.py [--numel 4194304] [--threads 1] [--store]

``--store``: instead, what FSDP's compression state costs to store and load per element kind
(``commpress.fsdp.residuals.ResidualStore``, blocks of 64: int8 / int4 on the native stochastic
kernel, ternary as the store runs it), beside ``copy_`` of the same tensor; then the ternary
kind's encode and decode on its fast path (:mod:`commpress.kernels.ternary`: the native
``ternary_encode_sr`` / ``ternary_decode`` where built) against its specification
(:mod:`commpress.spec.ternary`, vectorised torch).

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
    p.add_argument("--store", action="store_true", help="time the FSDP compression state's kinds instead")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    x = torch.randn(args.numel)
    out = torch.empty_like(x)
    if args.store:
        store_kinds(x, out, args.threads)
        return
    print(f"{args.numel} float32, block {args.block}, {args.threads} thread(s), torch {torch.__version__}")
    for bits in (8, 4):
        s, f = spec.encode_reference(x, bits, args.block)
        enc_ref = best_ms(lambda: spec.encode_reference(x, bits, args.block))
        enc_fast = best_ms(lambda: fast.encode(x, bits, args.block))
        dec_ref = best_ms(lambda: spec.decode_reference(s, f, bits, args.block, out))
        dec_fast = best_ms(lambda: fast.decode(s, f, bits, args.block, out))
        print(f"int{bits}: encode reference {enc_ref:.1f} ms, fast {enc_fast:.1f} ms; "
              f"decode reference {dec_ref:.1f} ms, fast {dec_fast:.1f} ms")


def store_kinds(x: torch.Tensor, out: torch.Tensor, threads: int) -> None:
    """Milliseconds to store (put) and load (get) ``x`` in each quantised kind, and ``copy_``'s."""
    from commpress.fsdp import residuals

    copy_ms = best_ms(lambda: out.copy_(x))
    print(f"{x.numel()} float32, {threads} thread(s), torch {torch.__version__}: copy_ {copy_ms:.2f} ms")
    for kind in residuals.QUANTIZED:
        store = residuals.ResidualStore(kind, block=residuals.VELOCITY_BLOCK)
        put = best_ms(lambda: store.put("x", x, seed=1))
        get = best_ms(lambda: store.get("x"))
        print(f"{kind}: {store.nbytes() / x.numel():.4f} bytes/element; put {put:.1f} ms ({put / copy_ms:.0f}x copy_), "
              f"get {get:.1f} ms ({get / copy_ms:.0f}x copy_)")
    from commpress.kernels import ops
    from commpress.kernels import ternary as ternary_fast
    from commpress.spec import ternary as ternary_spec

    block = residuals.VELOCITY_BLOCK
    n = x.numel()
    scales, packed = ternary_spec.encode_stochastic(x, block, 1)
    rows = {"spec": (lambda: ternary_spec.encode_stochastic(x, block, 1),
                     lambda: ternary_spec.decode(scales, packed, block, n))}
    backend = ops.backend_for("ternary_encode_sr", "cpu")
    rows[f"fast ({backend})"] = (lambda: ternary_fast.encode_stochastic(x, block, 1),
                                 lambda: ternary_fast.decode(scales, packed, block, n))
    for name, (encode, decode) in rows.items():
        put, get = best_ms(encode), best_ms(decode)
        print(f"ternary {name}: encode {put:.1f} ms ({put / copy_ms:.1f}x copy_), "
              f"decode {get:.1f} ms ({get / copy_ms:.1f}x copy_)")


if __name__ == "__main__":
    main()
