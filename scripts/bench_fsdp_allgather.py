"""FSDP2's parameter all-gather, FSDP's own vs commpress's ``param_codec`` (int8, int4), on digits.

Trains the demo digits MLP (every Linear ``fully_shard``-ed, then the root) once per case on
``--world`` gloo ranks (CPU, ``mp.spawn``), same initialisation, data and plain SGD, and prints
test accuracy, and per rank and step the bytes of the all-gathers (forward + backward: what the
rank hands to them, its shard or its encoded frame; FSDP's own all-gather in the same units)
next to the reduce-scatter's. ``param_codec=fsdp`` is FSDP's own all-gather with its bytes
counted (``param_codec="none"``: the option syntax reads ``none`` as None); ``mp=bf16`` adds ``MixedPrecisionPolicy(param_dtype=bfloat16)``. Cases:
``label=codec[:key=value,...]`` (``codec`` is the reduce-scatter's).

    python scripts/bench_fsdp_allgather.py --world 2 --steps 300
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from commpress.demo.workloads import digits_mlp, digits_split

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ddp_convergence as convergence  # noqa: E402 - the shared worker, options and case parser

DEFAULT_CASES = [
    "fp32=none:param_codec=fsdp",
    "int8=none:param_codec=int8",
    "int4=none:param_codec=int4",
    "bf16mp=none:param_codec=fsdp,mp=bf16",
    "bf16mp+int8=none:param_codec=int8,mp=bf16",
    "int8+topk1%=topk:ratio=0.01,param_codec=int8",
]


def train_case(rank: int, world: int, args: argparse.Namespace, codec: str, opts: dict[str, Any]) -> dict[str, Any]:
    import commpress.fsdp

    opts = dict(opts)
    mp = opts.pop("mp", None)
    if opts.get("param_codec") == "fsdp":
        opts["param_codec"] = "none"
    kw: dict[str, Any] = {} if mp is None else {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}
    xtr, ytr, xte, yte = digits_split()
    shard = torch.arange(rank, len(ytr), world)
    torch.manual_seed(args.seed)
    model = digits_mlp(args.width, args.width)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, **kw)
    fully_shard(model, **kw)
    state = commpress.fsdp.register(model, codec, seed=args.seed, **opts)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    g = torch.Generator().manual_seed(1000 * args.seed + 17 + rank)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        idx = shard[torch.randint(0, len(shard), (args.batch,), generator=g)]
        loss = F.cross_entropy(model(xtr[idx]).float(), ytr[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    wall = time.perf_counter() - t0
    st = state.stats()
    with torch.no_grad():
        out = model(xte).float()
        acc = (out.argmax(1) == yte).float().mean().item() * 100
    steps = max(args.steps, 1)
    return {
        "test_acc": acc, "wall_s": wall, "params": sum(p.numel() for p in model.parameters()),
        "allgather_bytes_per_step": st["allgather_bytes_sent"] / steps,
        "allgather_dense_bytes_per_step": st["allgather_dense_bytes"] / steps,
        "allgather_ratio": st["allgather_compression_ratio"],
        "allgather_calls_per_step": st["allgather_calls"] / steps,
        "reducescatter_bytes_per_step": st["bytes_sent_per_step"],
        "reducescatter_dense_bytes_per_step": st["dense_bytes_per_step"],
    }


def main(argv: list[str] | None = None) -> int:
    args = convergence.common_parser(__doc__.splitlines()[0], DEFAULT_CASES).parse_args(argv)
    t0 = time.perf_counter()
    results = convergence.run_cases(args, train_case)
    print(
        f"digits MLP 64-{args.width}-{args.width}-10 under FSDP2, {args.world} ranks x batch {args.batch}, "
        f"{args.steps} steps, SGD lr={args.lr} momentum={args.momentum}, torch {torch.__version__}; "
        "bytes per rank and step"
    )
    print(f"{'case':14s} {'test acc':>8s} {'AG B':>8s} {'AG FSDP B':>9s} {'AG ratio':>8s} {'RS B':>8s} "
          f"{'RS FSDP B':>9s} {'wall s':>6s}")
    for label, r in results.items():
        print(
            f"{label:14s} {r['test_acc']:8.2f} {r['allgather_bytes_per_step']:8.0f} "
            f"{r['allgather_dense_bytes_per_step']:9.0f} {r['allgather_ratio']:8.2f} "
            f"{r['reducescatter_bytes_per_step']:8.0f} {r['reducescatter_dense_bytes_per_step']:9.0f} {r['wall_s']:6.1f}"
        )
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
