"""Convergence of the MPI parameter server per mode and codec on the digits demo.

One mpirun launch runs every (mode, codec) pair in turn through commpress.ps.run and rank 0
prints a table (and optionally JSON):

    mpirun -n 4 --oversubscribe python scripts/ps_convergence.py --steps 400

ssp/async runs get a straggler (worker 1 sleeps --straggle seconds per step) so the
staleness bound is exercised; the table's "lead" column is the largest lead of a worker over
the slowest one that the servers' logs recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np
import torch
from mpi4py import MPI

from commpress import ps
from commpress.ps.__main__ import summary
from commpress.ps.demos import digits_task

DEFAULT_CODECS = ["none", "fp16", "bf16", "topk:ratio=0.05", "randomk:ratio=0.1", "sign", "qsgd:bits=4"]


def max_lead(log_dir: str) -> int:
    lead = 0
    for name in os.listdir(log_dir):
        with open(os.path.join(log_dir, name)) as f:
            for line in f:
                ev = json.loads(line)
                if ev["event"] == "reply":
                    lead = max(lead, ev["ahead"])
    return lead


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--modes", default="sync,async,ssp")
    p.add_argument("--codecs", default=",".join(DEFAULT_CODECS), help="';'-separated codec specs")
    p.add_argument("--async-codecs", default="none,topk:ratio=0.05", help="codecs for async/ssp (';'-separated)")
    p.add_argument("--staleness", type=int, default=2)
    p.add_argument("--straggle", type=float, default=0.003)
    p.add_argument("--pull-codec", default="same")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="rank 0 writes the rows here")
    args = p.parse_args()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    workers = comm.Get_size() - args.servers
    task = digits_task(seed=args.seed)
    sep = ";" if ";" in args.codecs else ","
    codecs = [c for c in args.codecs.split(sep) if c] if sep == ";" else _split(args.codecs)
    acodecs = _split(args.async_codecs)
    rows = []
    for mode in args.modes.split(","):
        for codec in codecs if mode == "sync" else acodecs:
            log_dir = shared_tempdir(comm)
            faults = () if mode == "sync" else (ps.Fault("slow", 1, None, args.straggle),)
            cfg = ps.PSConfig(servers=args.servers, mode=mode, staleness=args.staleness, steps=args.steps,
                              codec=codec, pull_codec=args.pull_codec, progress=False, log_dir=log_dir,
                              seed=args.seed, faults=faults)
            result = ps.run(task, cfg)
            if result.rank == 0:
                rep = summary(result, cfg, workers)
                rep["lead"] = max_lead(log_dir)
                rows.append(rep)
                print(f"done {mode} {codec}: {rep['metrics']['test_accuracy']:.2f}%", file=sys.stderr, flush=True)
    if comm.Get_rank() == 0:
        base = {r["mode"]: r["metrics"]["test_accuracy"] for r in rows if r["codec"] == "none"}
        sync_none = base.get("sync")
        print(f"digits MLP, {workers} workers, {args.servers} server(s), {args.steps} steps, "
              f"batch 32/worker, SGD momentum 0.9 lr 0.05, seed {args.seed}")
        print(f"{'mode':5} {'codec':36} {'acc %':>6} {'vs sync none':>12} {'push B':>7} {'pull B':>7} "
              f"{'resyncs':>7} {'lead':>4} {'s':>5}")
        for r in rows:
            acc = r["metrics"]["test_accuracy"]
            d = "" if sync_none is None else f"{acc - sync_none:+.2f}"
            print(f"{r['mode']:5} {r['codec']:36} {acc:6.2f} {d:>12} {r['push_bytes_per_step_per_worker']:7.0f} "
                  f"{r['pull_bytes_per_step_per_worker']:7.0f} {r['resyncs']:7d} {r['lead']:4d} {r['seconds']:5.1f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    return 0


def shared_tempdir(comm: MPI.Comm) -> str:
    """A fresh directory made by rank 0, its name broadcast as bytes (buffer method, no pickle)."""
    buf = np.zeros(512, dtype=np.uint8)
    if comm.Get_rank() == 0:
        name = tempfile.mkdtemp(prefix="ps-conv-").encode()
        buf[: len(name)] = np.frombuffer(name, dtype=np.uint8)
    comm.Bcast([buf, MPI.BYTE], root=0)
    return bytes(buf[buf != 0]).decode()


def _split(text: str) -> list[str]:
    """Split a list of codec specs on commas that start a new codec name."""
    out: list[str] = []
    for item in text.split(","):
        if out and "=" in item and ":" not in item:
            out[-1] += "," + item
        elif item:
            out.append(item)
    return out


if __name__ == "__main__":
    sys.exit(main())
