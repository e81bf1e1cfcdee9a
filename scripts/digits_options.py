"""Digits MLP on 2 gloo ranks exactly as the user-view check (shared/checks/defaults_digits.py), one
registration per argument, to measure what each option buys.

    python scripts/digits_options.py 'sign|{"_opt": true}|0.9' 'randomk|{"ratio": 0.01, "momentum": 0.9}|0'

Each argument is ``codec|hook options as JSON|optimizer momentum``: codec ``dense`` registers nothing;
``"_opt": true`` passes the optimizer (``optimizer=opt``); a negative momentum uses
``AdamW(lr=1e-3, weight_decay=0.01)`` instead of ``SGD(lr=0.1, momentum=...)``. ``SEED=k`` changes the model initialisation (the split stays); ``EPOCHS=n`` trains n epochs (12); ``GUARD_DEBUG=1``
logs the divergence guard's ratio on rank 0. Prints held-out accuracy, the loss per epoch and the guard's
counters.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def digits(rank: int, world: int) -> tuple[torch.Tensor, ...]:
    """The check's split: 1400 training images over the ranks, the rest held out."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x, y = torch.tensor(d.data, dtype=torch.float32) / 16, torch.tensor(d.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return x[:1400][rank::world], y[:1400][rank::world], x[1400:], y[1400:]


def worker(rank: int, world: int, port: int, name: str, kw: dict[str, Any], mom: float, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if rank == 0 and os.environ.get("GUARD_DEBUG"):
        logging.basicConfig(level=logging.DEBUG, format="%(message)s")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    xtr, ytr, xte, yte = digits(rank, world)
    torch.manual_seed(int(os.environ.get("SEED", "0")))  # the model init; SEED=1,2,... for the spread
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    ddp = DDP(model, bucket_cap_mb=1)
    if mom >= 0:
        opt: torch.optim.Optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=mom)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.01)
    state = None
    if name != "dense":
        import commpress.ddp

        if kw.pop("_opt", False):
            kw["optimizer"] = opt
        state = commpress.ddp.register(ddp, name, **kw)
    losses = []
    for _ in range(int(os.environ.get("EPOCHS", "12"))):
        for i in range(0, len(xtr), 35):
            loss = nn.functional.cross_entropy(ddp(xtr[i : i + 35]), ytr[i : i + 35])
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses.append(round(loss.item(), 3))
    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).float().mean().item()
    if rank == 0:
        guard = {k: v for k, v in state.stats().items() if k.startswith("guard")} if state else None
        q.put({"acc": acc, "losses": losses, "guard": guard})
    dist.destroy_process_group()


def run(name: str, kw: dict[str, Any], mom: float) -> dict[str, Any] | None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, 2, port, name, dict(kw), mom, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        res = q.get(timeout=300)
    except Exception:
        res = None
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return res


if __name__ == "__main__":
    for spec in sys.argv[1:]:
        name, kw, mom = spec.split("|")
        t = time.time()
        r = run(name, json.loads(kw), float(mom))
        if r is None:
            print(f"{spec}: FAILED", flush=True)
        else:
            print(f"{spec}: acc={100 * r['acc']:.1f} losses={r['losses']} guard={r['guard']} ({time.time() - t:.0f}s)",
                  flush=True)
