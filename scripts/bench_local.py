"""Low-communication training at equal steps: DDP every step vs LocalSGD vs DiLoCo (dense and compressed outer).

2 gloo ranks on loopback, the digits MLP (``commpress.demo.workloads``: 64-256-256-10) with the
user's ``SGD(lr=0.1, momentum=0.9)`` as the (inner) optimizer, batches of 32 per rank drawn from
each rank's half of the training set. Prints, per method: held-out loss and accuracy of the
synced parameters (DiLoCo: the global copy, after ``flush()``), bytes each rank handed to
collectives in total, and the ratio to DDP's; for streaming DiLoCo also the peak bytes one sync
has in flight, and the seconds the inner loop blocked on syncs (``sync_wait_s``) against the
syncs' launch-to-completion time (``sync_transfer_s``), summed over rank 0's run (wall-clock:
noisy under load; loopback, so the transfers are short).

    PYTHONPATH=$PWD python scripts/bench_local.py --steps 640 --sync-every 16
    PYTHONPATH=$PWD python scripts/bench_local.py --only streaming --fragments 4 --overlap 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import commpress.local
from commpress.demo.workloads import digits_mlp, digits_split, seeded

#: (label, kind, options)
METHODS: list[tuple[str, str, dict[str, Any]]] = [
    ("DDP all-reduce every step", "ddp", {}),
    ("LocalSGD", "localsgd", {}),
    ("DiLoCo default (qsgd 4-bit outer, overlap H/4, alpha 0.5)", "diloco", {}),
    ("DiLoCo qsgd 4-bit outer, blocking (overlap 0)", "diloco", {"overlap": 0}),
    ("DiLoCo dense outer, blocking", "diloco", {"codec": "none", "overlap": 0}),
    ("DiLoCo dense outer, overlap H/4, alpha 0.5", "diloco", {"codec": "none"}),
    ("DiLoCo qsgd 8-bit outer, blocking", "diloco", {"codec": "qsgd", "bits": 8, "overlap": 0}),
    ("DiLoCo sign outer (EF), blocking", "diloco", {"codec": "sign", "overlap": 0}),
    ("DiLoCo top-k 1% outer (EF), blocking", "diloco", {"codec": "topk", "ratio": 0.01, "overlap": 0}),
    ("DiLoCo dense outer, paper's lr 0.7 m 0.9, blocking", "diloco",
     {"codec": "none", "outer_lr": 0.7, "outer_momentum": 0.9, "overlap": 0}),
    ("DiLoCo qsgd 4-bit outer, paper's lr 0.7 m 0.9, blocking", "diloco",
     {"outer_lr": 0.7, "outer_momentum": 0.9, "overlap": 0}),
    ("streaming DiLoCo, fragments 2, blocking", "diloco", {"fragments": 2, "overlap": 0}),
    ("streaming DiLoCo, fragments 4, blocking", "diloco", {"fragments": 4, "overlap": 0}),
    ("streaming DiLoCo, fragments 4, overlap 1, alpha 0.5", "diloco", {"fragments": 4, "overlap": 1}),
    ("streaming DiLoCo, fragments 4, overlap 4, alpha 0 (replace)", "diloco", {"fragments": 4, "overlap": 4, "merge_alpha": 0.0}),
    ("streaming DiLoCo, fragments 4, overlap 4, alpha 0.5", "diloco", {"fragments": 4, "overlap": 4}),
    ("streaming DiLoCo, fragments 1, overlap H/4, alpha 0 (replace)", "diloco", {"merge_alpha": 0.0}),
]


def run_one(rank: int, world: int, kind: str, options: dict[str, Any], steps: int, sync_every: int) -> dict[str, float]:
    xtr, ytr, xte, yte = digits_split()
    xtr, ytr = xtr[rank::world], ytr[rank::world]
    torch.manual_seed(0)
    model = digits_mlp(256, 256)
    numel = sum(p.numel() for p in model.parameters())
    net: torch.nn.Module = DDP(model) if kind == "ddp" else model
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    trainer: Any = None
    if kind == "localsgd":
        trainer = commpress.local.LocalSGD(model, opt, sync_every=sync_every)
    elif kind == "diloco":
        trainer = commpress.local.DiLoCo(model, opt, sync_every=sync_every, **options)
    ctx = trainer if trainer is not None else _Null()
    with ctx:
        for step in range(steps):
            idx = torch.randint(0, len(ytr), (32,), generator=seeded(7, rank, step))
            opt.zero_grad()
            F.cross_entropy(net(xtr[idx]), ytr[idx]).backward()
            opt.step()
    extra: dict[str, float] = {}
    if kind == "diloco":  # evaluate the global copy (between syncs the fragments differ per rank)
        trainer.finish()  # merge the sync in flight and load the global copy into the model
        s = trainer.stats()
        extra = {k: s[k] for k in ("peak_bytes_in_flight", "sync_wait_s", "sync_transfer_s", "syncs")}
    with torch.no_grad():
        logits = model(xte)
        loss = float(F.cross_entropy(logits, yte))
        acc = float((logits.argmax(1) == yte).float().mean())
    sent = numel * 4.0 * steps if kind == "ddp" else float(trainer.stats()["bytes_sent"])
    return {"loss": loss, "acc": acc, "bytes": sent, **extra}


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _entry(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    results = []
    methods = [m for m in METHODS if not args.only or any(o in m[0] for o in args.only)]
    if args.fragments or args.overlap:  # the row of --fragments / --overlap runs whatever --only says
        methods.append((f"streaming DiLoCo, fragments {args.fragments or 1}, overlap {args.overlap}, alpha {args.merge_alpha}",
                        "diloco", {"fragments": args.fragments or 1, "overlap": args.overlap, "merge_alpha": args.merge_alpha}))
    for label, kind, options in methods:
        results.append({"label": label, **run_one(rank, world, kind, options, args.steps, args.sync_every)})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=640)
    parser.add_argument("--sync-every", type=int, default=16)
    parser.add_argument("--only", nargs="*", default=[], help="run only methods whose label contains one of these "
                        "(--only - with --fragments/--overlap: that row alone)")
    parser.add_argument("--fragments", type=int, default=0, help="add a streaming DiLoCo row with this many fragments")
    parser.add_argument("--overlap", type=int, default=0, help="... and this overlap (inner steps)")
    parser.add_argument("--merge-alpha", type=float, default=0.5, help="... and this merge_alpha")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        mp.spawn(_entry, args=(2, port, args, out), nprocs=2)
        with open(out) as f:
            results = json.load(f)
    ddp_bytes = next((r["bytes"] for r in results if r["label"].startswith("DDP")), None)
    print(f"digits MLP, 2 gloo ranks, inner SGD(lr=0.1, momentum=0.9), batch 32/rank, {args.steps} steps, "
          f"H={args.sync_every}; torch {torch.__version__}")
    print("| method | held-out loss | accuracy | bytes sent per rank | DDP bytes / bytes | peak bytes in flight "
          "| sync wait / transfer (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        ratio = f"{ddp_bytes / r['bytes']:.0f}x" if ddp_bytes and r["bytes"] else "-"
        peak = f"{r['peak_bytes_in_flight'] / 1e3:.1f} kB" if "peak_bytes_in_flight" in r else "-"
        wait = f"{r['sync_wait_s']:.3f} / {r['sync_transfer_s']:.3f}" if "sync_wait_s" in r else "-"
        print(f"| {r['label']} | {r['loss']:.4f} | {100 * r['acc']:.1f}% | {r['bytes'] / 1e6:.2f} MB | {ratio} | {peak} "
              f"| {wait} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
