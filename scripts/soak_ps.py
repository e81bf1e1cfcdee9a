"""Soak of the parameter server: sync mode, compressed push and pull; leaks and replica drift per rank, in a table.

Run under mpirun (as root add ``OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``)::

    mpirun -n 4 --oversubscribe python scripts/soak_ps.py --steps 500 --every 50
    mpirun -n 4 --oversubscribe python scripts/soak_ps.py --steps 5000 --every 250   # the long soak

The first ``--servers`` ranks serve (2 by default: two shards), the others train an MLP on a
teacher's labels through :func:`commpress.ps.run` in sync mode, pushing with ``--codec``
(top-k 1 % with error feedback by default) and answered with ``--pull-codec`` (sign by
default: the servers send the compressed update ``x - replica``, or the dense shard when that
would leave more than ``--max-drift``; 0.05 here, where 1 reply in 10 goes dense over the
first 500 steps and fewer later, so both kinds of reply are soaked: at the default 0.01 it is 2
in 3, measured 664 of 1,000 in 500 steps). Every ``--every`` steps the
run's ``on_step`` callback (:class:`commpress.ps.StepView`; it sends nothing) records on each
rank its resident memory (``VmRSS``), open file descriptors, threads and digests of the
parameters: a worker digests each shard's part of its parameter vector, a server the replica
of its shard, which is what every worker must hold after the step's broadcast reply. Rank 0
gathers the records after the run (outside it) and prints one row per recording step.

What must be identical: in sync mode every server sends one reply per step to all workers and
each worker adds it to its copy, as the server adds it to its replica, so all workers hold the
same bits, equal to the servers' replicas. The servers' own shards ``x`` legitimately differ
from them by what the pull codec has not sent yet (bounded by ``--max-drift``); the final PULL
then hands every worker ``x`` exactly, which is checked too. The exit status is 1 if any row
or the final check differs (``--max-rss-growth`` also makes RSS growth a check), else 0.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import soak_common
import torch
import torch.nn.functional as F
from torch import nn

from commpress import ps
from commpress.ps import mpi_loop
from commpress.ps.__main__ import summary

IN, HIDDEN, OUT, BATCH = 64, 256, 10, 32


def task(seed: int = 0) -> ps.Task:
    """An MLP learning a linear teacher's argmax; worker ``w``'s batch at step ``t`` is a pure function of both."""
    teacher = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(seed + 1))

    def batch(w: int, workers: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(BATCH, IN, generator=torch.Generator().manual_seed(10_000 * step + w))
        return x, (x @ teacher).argmax(1)

    def loss(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(b[0]), b[1])

    def evaluate(model: nn.Module) -> dict[str, float]:
        x = torch.randn(1024, IN, generator=torch.Generator().manual_seed(seed + 2))
        logits, y = model(x), (x @ teacher).argmax(1)
        return {"loss": float(F.cross_entropy(logits, y)), "accuracy": float((logits.argmax(1) == y).float().mean())}

    return ps.Task(
        model=lambda: nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                                    nn.Linear(HIDDEN, OUT)),
        loss=loss, batch=batch, optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        evaluate=evaluate,
    )


class Recorder:
    """The ``on_step`` callback: every ``every`` steps (and the last), ``[step, rss, fds, threads, digest per shard]``.

    A worker fills every shard's digest; server ``s`` only its own (the others stay 0).
    """

    def __init__(self, every: int, steps: int, servers: int) -> None:
        self.every, self.steps, self.servers = every, steps, servers
        self.rows: list[list[int]] = []

    def __call__(self, view: ps.StepView) -> None:
        if view.step % self.every and view.step != self.steps:
            return
        digests = [0] * self.servers
        if view.role == "worker":
            for sh in view.layout.shards:
                digests[sh.index] = soak_common.digest([view.params[sh.start : sh.stop]])
        else:
            assert view.replica is not None, "the soak runs in sync mode: servers keep one replica"
            digests[view.index] = soak_common.digest([view.replica])
        self.rows.append([view.step, *soak_common.sample(), *digests])


def table_rows(gathered: list[list[list[int]]], servers: int) -> list[soak_common.Row]:
    """One :class:`soak_common.Row` per recording step; ``same``: every shard's digest agrees on every rank holding it."""
    rows = []
    for i, step_row in enumerate(gathered[0]):
        per = [rank_rows[i] for rank_rows in gathered]
        same = all(r[0] == step_row[0] for r in per) and all(
            len({per[s][4 + s]} | {r[4 + s] for r in per[servers:]}) == 1 for s in range(servers))
        rows.append(soak_common.Row(step_row[0], [r[1:4] for r in per], same))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the soak on ``MPI.COMM_WORLD``; rank 0 prints the table. 1 if replicas ever differed (every rank returns it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--every", type=int, default=50, help="record every this many steps")
    parser.add_argument("--warmup", type=int, default=100, help="RSS growth is measured from the first row after this")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--codec", default="topk:ratio=0.01", help="push codec (default topk:ratio=0.01)")
    parser.add_argument("--pull-codec", default="sign", help="reply codec (default sign)")
    parser.add_argument("--max-drift", type=float, default=0.05,
                        help="default 0.05: at the product's 0.01, sign replies on this model resync 2 in 3 times")
    parser.add_argument("--max-rss-growth", type=float, default=None, help="percent; exit 1 beyond it")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.every < 1:
        parser.error("--steps and --every must be >= 1")
    torch.set_num_threads(1)
    comm = mpi_loop.world()
    world = comm.Get_size()
    cfg = ps.PSConfig(servers=args.servers, mode="sync", steps=args.steps, codec=args.codec, pull_codec=args.pull_codec,
                      max_drift=args.max_drift, progress=False)
    record = Recorder(args.every, args.steps, args.servers)
    started = time.perf_counter()
    result = ps.run(task(), cfg, comm, on_step=record)
    seconds = time.perf_counter() - started
    ps.finish(result, comm)
    # after the run, on the world communicator (the run used its own duplicate, now freed)
    final = soak_common.digest([result.params]) if result.params is not None else 0
    gathered: list[Any] | None = comm.gather((record.rows, final), root=0)
    code = 0
    if gathered is not None:
        S, W = args.servers, world - args.servers
        print(f"soak (parameter server): {args.steps} steps, sync, {S} server(s) + {W} workers in {seconds:.1f} s; "
              f"push {cfg.codec}, pull {cfg.pull_codec}; torch {torch.__version__}")
        names = [f"s{s}" for s in range(S)] + [f"w{w}" for w in range(W)]
        rows = table_rows([rank_rows for rank_rows, _ in gathered], S)
        g = soak_common.report(rows, names, args.warmup, "replicas identical")
        rep = summary(result, cfg, W)
        final_same = len({f for _, f in [gathered[0], *gathered[S:]]}) == 1
        print(f"bytes/step/worker: push {rep['push_bytes_per_step_per_worker']:.0f}, pull "
              f"{rep['pull_bytes_per_step_per_worker']:.0f} (dense {rep['dense_bytes_per_step_per_worker']}); "
              f"resyncs {rep['resyncs']}, max drift {rep['max_drift']:.3g}; final "
              + ", ".join(f"{k} {v:.4g}" for k, v in rep["metrics"].items()))
        print(f"workers' replicas equal the servers' at every row: {'yes' if g.identical_everywhere else 'NO'}; "
              f"after the final pull every worker holds the servers' parameters: {'yes' if final_same else 'NO'}")
        code = 0 if g.identical_everywhere and final_same else 1
        if args.max_rss_growth is not None and max(g.rss_percent) > args.max_rss_growth:
            print(f"RSS grew more than {args.max_rss_growth}%")
            code = 1
        sys.stdout.flush()
    return int(comm.bcast(code, root=0))


if __name__ == "__main__":
    sys.exit(main())
