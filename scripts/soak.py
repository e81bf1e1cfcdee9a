"""Soak: DDP with ``auto`` and the divergence guard for many steps; leaks and drift per rank, in a table.

Run::

    python scripts/soak.py --steps 500 --ranks 4 --every 50       # ~2-4 min on 2 CPU cores
    python scripts/soak.py --steps 5000 --ranks 4 --every 250     # the long soak (issue #28)

Each rank (gloo, CPU, one thread) trains an MLP with ``commpress.ddp.register(ddp, "auto",
optimizer=opt, ...)``. So that ``auto`` really switches, the link it plans for alternates every
``--switch-every`` steps between ``--slow-gbit`` and ``--fast-gbit`` (``state.auto.set_link``):
at the slow link it compresses, at the fast one it goes dense, re-deciding every
``--auto-interval`` steps. The divergence guard runs with ``--guard-threshold`` (lower than the
default 20, so that it fires on this small model). Every ``--every`` steps every rank records
its resident memory (``VmRSS``), open file descriptors (``/proc/self/fd``), threads and a digest
of its parameters' bytes; rank 0 gathers them and prints one row. At the end: RSS growth from the
first row after ``--warmup`` steps to the last, fd and thread growth, guard firings, ``auto``
switches, and whether every rank held bit-identical parameters at every row. The exit status
is 1 if the ranks ever differed, 0 otherwise (the growth figures are reported, not judged:
``--max-rss-growth`` makes them a check).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import socket
import sys
import time
from typing import Any

import soak_common
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import commpress.ddp
from commpress.comm.costmodel import Link
from commpress.optim import DivergenceGuard


def _sample(model: nn.Module) -> list[int]:
    return [*soak_common.sample(), soak_common.digest(model.parameters())]


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.1)  # a few buckets
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    slow, fast = Link.from_gbit(args.slow_gbit), Link.from_gbit(args.fast_gbit)
    guard = DivergenceGuard(interval=10, threshold=args.guard_threshold, dense_steps=20)
    state = commpress.ddp.register(ddp, "auto", optimizer=opt, auto_link=slow, auto_interval=args.auto_interval,
                                   divergence_guard=guard)
    teacher = torch.randn(64, 10, generator=torch.Generator().manual_seed(1))
    rows: list[list[int]] = []
    started = time.perf_counter()
    for step in range(args.steps):
        if step and step % args.switch_every == 0:
            assert state.auto is not None
            state.auto.set_link(fast if (step // args.switch_every) % 2 else slow)
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(10_000 * step + rank))
        opt.zero_grad()
        F.cross_entropy(ddp(x), (x @ teacher).argmax(1)).backward()
        opt.step()
        if (step + 1) % args.every == 0 or step + 1 == args.steps:
            mine = torch.tensor(_sample(model), dtype=torch.int64)
            everyone = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(everyone, mine)
            rows.append([step + 1] + torch.stack(everyone).reshape(-1).tolist())
    if rank == 0:
        s = state.stats()
        out.put({"rows": rows, "seconds": time.perf_counter() - started, "guard_fired": s["guard_fired"],
                 "guard_dense_steps": s["guard_dense_steps"], "auto_switches": s.get("auto_switches", 0),
                 "compression_ratio": s["compression_ratio"]})
    del ddp, state, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    """Run the soak and print its table; 1 if the ranks ever differed (or RSS grew beyond the limit)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--every", type=int, default=50, help="record every this many steps")
    parser.add_argument("--warmup", type=int, default=100, help="RSS growth is measured from the first row after this")
    parser.add_argument("--switch-every", type=int, default=100, help="alternate auto's link every this many steps")
    parser.add_argument("--auto-interval", type=int, default=25)
    parser.add_argument("--slow-gbit", type=float, default=0.05)
    parser.add_argument("--fast-gbit", type=float, default=400.0)
    parser.add_argument("--guard-threshold", type=float, default=3.0)
    parser.add_argument("--max-rss-growth", type=float, default=None, help="percent; exit 1 beyond it")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.every < 1 or args.ranks < 1:
        parser.error("--steps, --every and --ranks must be >= 1")
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.spawn(_rank, args=(args.ranks, _free_port(), args, out), nprocs=args.ranks, join=True)
    result = out.get()
    rows, world = result["rows"], args.ranks
    print(f"soak: {args.steps} steps at {world} ranks in {result['seconds']:.1f} s; torch {torch.__version__}")
    table = []
    for row in rows:
        per = [row[1 + 4 * r: 5 + 4 * r] for r in range(world)]
        table.append(soak_common.Row(row[0], [p[:3] for p in per], len({p[3] for p in per}) == 1))
    g = soak_common.report(table, [f"r{r}" for r in range(world)], args.warmup)
    print(f"guard fired {result['guard_fired']:.0f} times ({result['guard_dense_steps']:.0f} dense steps), "
          f"auto switches {result['auto_switches']:.0f}, compression x{result['compression_ratio']:.2f}; "
          f"ranks bit-identical at every row: {'yes' if g.identical_everywhere else 'NO'}")
    failed = not g.identical_everywhere
    if args.max_rss_growth is not None and max(g.rss_percent) > args.max_rss_growth:
        print(f"RSS grew more than {args.max_rss_growth}%")
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
