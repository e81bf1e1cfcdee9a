"""Convergence of the commpress DDP hook against dense DDP on real data (scikit-learn digits).

Data and model are the shared demo workloads (``commpress.demo.workloads``: the fixed digits
split with 360 held-out images, the MLP 64-width-width-10).

Trains the same MLP with the same optimizer, initialisation and data order once per case on
``--world`` gloo ranks (CPU, ``mp.spawn``) and prints test accuracy, bytes per step and the
compression ratio; ``--json`` writes the table (the tests read it). Each case is one line of
``--cases``: ``label=codec[:key=value,...]``, with ``dense`` meaning no hook at all.

    python scripts/ddp_convergence.py                   # the default table
    python scripts/ddp_convergence.py --momentum 0.9    # SGD + momentum instead of plain SGD
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from commpress.codecs import parse_params
from commpress.demo.workloads import digits_mlp, digits_split

DEFAULT_CASES = [
    "dense=dense",
    "topk1%+EF=topk:ratio=0.01",
    "topk1%-EF=topk:ratio=0.01,error_feedback=False",
    "sign256+EF=sign:block_size=256",
    "sign256-EF=sign:block_size=256,error_feedback=False",
]


def parse_case(text: str) -> tuple[str, str, dict[str, Any]]:
    """``label=codec[:key=value,...]`` -> (label, codec, options), with the package's option parser."""
    label, _, spec = text.partition("=")
    codec, _, rest = spec.partition(":")
    return label, codec, parse_params(rest, f"case {text!r}")


def train_case(rank: int, world: int, args: argparse.Namespace, codec: str, opts: dict[str, Any]) -> dict[str, Any]:
    import commpress.ddp

    xtr, ytr, xte, yte = digits_split()
    shard = torch.arange(rank, len(ytr), world)  # each rank its own part of the training set
    torch.manual_seed(args.seed)
    model = digits_mlp(args.width, args.width)
    ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    state = None
    if codec != "dense":
        state = commpress.ddp.register(ddp, codec, seed=args.seed, **opts)
    # With the hook's momentum correction the momentum moves into the hook: the optimizer then
    # runs without it (same update rule as dense SGD + momentum, computed before compression).
    momentum = 0.0 if opts.get("momentum") else args.momentum
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=momentum)
    g = torch.Generator().manual_seed(1000 * args.seed + 17 + rank)
    t0 = time.perf_counter()
    for step in range(args.steps):
        idx = shard[torch.randint(0, len(shard), (args.batch,), generator=g)]
        loss = F.cross_entropy(ddp(xtr[idx]), ytr[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    wall = time.perf_counter() - t0
    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).float().mean().item() * 100
        train_acc = (model(xtr).argmax(1) == ytr).float().mean().item() * 100
    out: dict[str, Any] = {"test_acc": acc, "train_acc": train_acc, "wall_s": wall}
    if state is not None:
        st = state.stats()
        out.update(
            bytes_per_step=st["bytes_sent_per_step"], dense_bytes_per_step=st["dense_bytes_per_step"],
            ratio=st["compression_ratio"], wire_ratio=st["wire_ratio"], encode_s=st["encode_s"],
            decode_s=st["decode_s"],
        )
    else:
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        out.update(bytes_per_step=nbytes, dense_bytes_per_step=nbytes, ratio=1.0, wire_ratio=1.0)
    return out


def worker(rank: int, world: int, port: int, args: argparse.Namespace, results_path: str,
           train: Callable[..., dict[str, Any]] | None = None) -> None:
    """One rank: every case of ``args.cases`` through ``train`` (default: DDP's :func:`train_case`)."""
    train = train or train_case
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    results = {}
    for case in args.cases:
        label, codec, opts = parse_case(case)
        results[label] = {"codec": codec, "options": {k: str(v) for k, v in opts.items()},
                          **train(rank, world, args, codec, opts)}
    if rank == 0:
        with open(results_path, "w") as f:
            json.dump(results, f, indent=1)
    gc.collect()  # free the DDP models before destroying the group (torch aborts at exit otherwise)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def common_parser(description: str, default_cases: list[str]) -> argparse.ArgumentParser:
    """The options this script shares with ``bench_fsdp.py`` (same model, data and optimizer)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", nargs="+", default=default_cases)
    p.add_argument("--json", help="write the results here")
    return p


def run_cases(args: argparse.Namespace, train: Callable[..., dict[str, Any]] | None = None) -> dict[str, Any]:
    """Spawn ``args.world`` gloo ranks, run every case, return rank 0's results."""
    path = args.json or f"/tmp/convergence_{os.getpid()}.json"
    mp.spawn(worker, args=(args.world, free_port(), args, path, train), nprocs=args.world, join=True)
    with open(path) as f:
        return dict(json.load(f))


def main(argv: list[str] | None = None) -> int:
    p = common_parser(__doc__.splitlines()[0], DEFAULT_CASES)
    p.add_argument("--bucket-cap-mb", type=float, default=0.05)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    results = run_cases(args)
    dense = results.get("dense", {}).get("test_acc")
    print(
        f"digits MLP 64-{args.width}-{args.width}-10, {args.world} ranks x batch {args.batch}, {args.steps} steps, "
        f"SGD lr={args.lr} momentum={args.momentum}, torch {torch.__version__}"
    )
    print(f"{'case':24s} {'test acc':>8s} {'vs dense':>8s} {'train':>6s} {'bytes/step':>10s} {'ratio':>6s} {'wire x':>6s} {'wall s':>6s}")
    for label, r in results.items():
        diff = "" if dense is None else f"{r['test_acc'] - dense:+.2f}"
        print(
            f"{label:24s} {r['test_acc']:8.2f} {diff:>8s} {r['train_acc']:6.2f} {r['bytes_per_step']:10.0f} "
            f"{r['ratio']:6.1f} {r['wire_ratio']:6.1f} {r['wall_s']:6.1f}"
        )
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
