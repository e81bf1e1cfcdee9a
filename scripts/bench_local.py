"""Low-communication training at equal steps: DDP every step vs LocalSGD vs DiLoCo (dense and compressed outer).

2 gloo ranks on loopback, the digits MLP (``commpress.demo.workloads``: 64-256-256-10) with the
user's ``SGD(lr=0.1, momentum=0.9)`` as the (inner) optimizer, batches of 32 per rank drawn from
each rank's half of the training set. Prints, per method: held-out loss and accuracy of the
synced parameters, bytes each rank handed to collectives in total, and the ratio to DDP's.

    PYTHONPATH=$PWD python scripts/bench_local.py --steps 640 --sync-every 16
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
    ("DiLoCo dense outer", "diloco", {"codec": "none"}),
    ("DiLoCo qsgd 8-bit outer", "diloco", {"codec": "qsgd", "bits": 8}),
    ("DiLoCo default (qsgd 4-bit outer)", "diloco", {}),
    ("DiLoCo sign outer (EF)", "diloco", {"codec": "sign"}),
    ("DiLoCo top-k 1% outer (EF)", "diloco", {"codec": "topk", "ratio": 0.01}),
    ("DiLoCo dense outer, paper's lr 0.7 m 0.9", "diloco", {"codec": "none", "outer_lr": 0.7, "outer_momentum": 0.9}),
    ("DiLoCo qsgd 4-bit outer, paper's lr 0.7 m 0.9", "diloco", {"outer_lr": 0.7, "outer_momentum": 0.9}),
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
    with torch.no_grad():
        logits = model(xte)
        loss = float(F.cross_entropy(logits, yte))
        acc = float((logits.argmax(1) == yte).float().mean())
    sent = numel * 4.0 * steps if kind == "ddp" else float(trainer.stats()["bytes_sent"])
    return {"loss": loss, "acc": acc, "bytes": sent}


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
    for label, kind, options in METHODS:
        if args.only and not any(o in label for o in args.only):
            continue
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
    parser.add_argument("--only", nargs="*", default=[], help="run only methods whose label contains one of these")
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
    print("| method | held-out loss | accuracy | bytes sent per rank | DDP bytes / bytes |")
    print("|---|---|---|---|---|")
    for r in results:
        ratio = f"{ddp_bytes / r['bytes']:.0f}x" if ddp_bytes and r["bytes"] else "-"
        print(f"| {r['label']} | {r['loss']:.4f} | {100 * r['acc']:.1f}% | {r['bytes'] / 1e6:.2f} MB | {ratio} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
