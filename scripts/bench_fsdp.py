"""FSDP2 with commpress's compressed reduce-scatter against FSDP's own, on real data (digits).

Trains the demo digits MLP (``commpress.demo.workloads``), every Linear ``fully_shard``-ed and
then the root, once per case on ``--world`` gloo ranks (CPU, ``mp.spawn``), same initialisation,
data and plain SGD, and prints test accuracy, bytes per rank and step (what FSDP's ring
reduce-scatter sends vs what the all_to_all sends), the ratio, and the error-feedback memory
per rank. ``dense`` is FSDP without commpress. Cases: ``label=codec[:key=value,...]``
(``residual_dtype=bf16`` for bfloat16 residuals). Gradient-only: the parameter all-gathers stay
FSDP's (``param_codec="none"`` unless a case gives ``param_codec=``; ``register``'s own default
would gather int8 parameters for a compressing codec). ``--json`` writes the table.

    python scripts/bench_fsdp.py --world 2
    python scripts/bench_fsdp.py --world 4 --json /tmp/fsdp4.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from commpress.demo.workloads import digits_mlp, digits_split

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ddp_convergence as convergence  # noqa: E402 - the shared worker, options and case parser

DEFAULT_CASES = [
    "dense=dense",
    "none=none",
    "fp16=fp16",
    "bf16=bf16",
    "topk1%=topk:ratio=0.01",
    "topk1%-bf16res=topk:ratio=0.01,residual_dtype=bf16",
    "randomk5%=randomk:ratio=0.05",
    "sign256=sign:block_size=256",
    "sign256-bf16res=sign:block_size=256,residual_dtype=bf16",
    "qsgd=qsgd",
]


def train_case(rank: int, world: int, args: argparse.Namespace, codec: str, opts: dict[str, Any]) -> dict[str, Any]:
    import commpress.fsdp

    xtr, ytr, xte, yte = digits_split()
    shard = torch.arange(rank, len(ytr), world)
    torch.manual_seed(args.seed)
    model = digits_mlp(args.width, args.width)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    state = (commpress.fsdp.register(model, codec, seed=args.seed, **{"param_codec": "none", **opts})
             if codec != "dense" else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    g = torch.Generator().manual_seed(1000 * args.seed + 17 + rank)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        idx = shard[torch.randint(0, len(shard), (args.batch,), generator=g)]
        loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    wall = time.perf_counter() - t0
    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).float().mean().item() * 100
        test_loss = F.cross_entropy(model(xte), yte).item()
    nparams = sum(p.numel() for p in model.parameters())
    dense_wire = (world - 1) * sum(
        # FSDP's flat gradient pads every parameter's dim 0 to a multiple of the world size
        -(-p.shape[0] // world) * world * (p.numel() // max(p.shape[0], 1)) for p in model.parameters()
    ) * 4 / world
    out: dict[str, Any] = {"test_acc": acc, "test_loss": test_loss, "wall_s": wall, "params": nparams,
                           "dense_bytes_per_step": dense_wire, "bytes_per_step": dense_wire, "ratio": 1.0,
                           "residual_bytes": 0}
    if state is not None:
        st = state.stats()
        out.update(bytes_per_step=st["bytes_sent_per_step"], dense_bytes_per_step=st["dense_bytes_per_step"],
                   ratio=st["compression_ratio"], residual_bytes=st["residual_bytes"], encode_s=st["encode_s"],
                   decode_s=st["decode_s"])
    return out


def train_parsed(rank: int, world: int, args: argparse.Namespace, codec: str, opts: dict[str, Any]) -> dict[str, Any]:
    """:func:`train_case` after reading ``residual_dtype`` (the shared worker parses plain options)."""
    if "residual_dtype" in opts:
        opts = {**opts, "residual_dtype": {"bf16": torch.bfloat16, "fp32": torch.float32}[opts["residual_dtype"]]}
    return train_case(rank, world, args, codec, opts)


def main(argv: list[str] | None = None) -> int:
    args = convergence.common_parser(__doc__.splitlines()[0], DEFAULT_CASES).parse_args(argv)
    t0 = time.perf_counter()
    results = convergence.run_cases(args, train_parsed)
    dense = results.get("dense", {}).get("test_acc")
    print(
        f"digits MLP 64-{args.width}-{args.width}-10 under FSDP2, {args.world} ranks x batch {args.batch}, "
        f"{args.steps} steps, SGD lr={args.lr} momentum={args.momentum}, torch {torch.__version__}"
    )
    print(f"{'case':18s} {'test acc':>8s} {'vs dense':>8s} {'loss':>6s} {'B/step/rank':>11s} {'FSDP B':>8s} "
          f"{'ratio':>6s} {'residual B':>10s} {'wall s':>6s}")
    for label, r in results.items():
        diff = "" if dense is None else f"{r['test_acc'] - dense:+.2f}"
        print(
            f"{label:18s} {r['test_acc']:8.2f} {diff:>8s} {r['test_loss']:6.3f} {r['bytes_per_step']:11.0f} "
            f"{r['dense_bytes_per_step']:8.0f} {r['ratio']:6.1f} {r['residual_bytes']:10d} {r['wall_s']:6.1f}"
        )
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
