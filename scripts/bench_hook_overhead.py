"""What the DDP hook itself costs: step time of hook configurations against DDP's own all-reduce.

    python scripts/bench_hook_overhead.py                     # the default cases, 3 rounds, 60 steps
    python scripts/bench_hook_overhead.py --steps 30 --rounds 2 --cases dense "none" "none@momentum=0.9"

Workload: ``bench_e2e``'s speed workload (``commpress.demo.runner.Workload("speed")``: the 17M
MLP, batch 64, ``SGD(lr=0.05, momentum=0.9)``), 2 gloo ranks on loopback, one thread each. A case is
``dense`` (no hook) or ``CODEC[@option=value,...]`` registered with ``optimizer=opt``, except that
``momentum=M`` instead moves the momentum into the hook by hand (the optimizer then runs without).
Cases alternate within each round, so drift on a shared machine hits them alike; the script prints
each case's ms per step (median over rounds) and its ratio to ``dense``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

DEFAULT_CASES = ["dense", "none", "none@momentum=0.9", "auto@auto_margin=0.99"]


def parse_case(case: str) -> tuple[str, dict[str, object]]:
    """``"auto@auto_margin=0.99"`` -> ``("auto", {"auto_margin": 0.99})`` (values as JSON, else strings)."""
    name, _, rest = case.partition("@")
    options: dict[str, object] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return name, options


def worker(rank: int, world: int, port: int, case: str, steps: int, out: str) -> None:
    """One rank: 3 untimed steps, then ``steps`` timed ones between barriers; rank 0 writes ms/step."""
    from commpress.demo.runner import Workload

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    work = Workload("speed", rank, world=world)  # bench_e2e's speed model, batches and optimizer
    ddp = DDP(work.model(), bucket_cap_mb=work.bucket_cap_mb)
    name, options = parse_case(case)
    momentum = options.pop("momentum", None)
    opt = work.optimizer(ddp.parameters(), momentum=0.0 if momentum else 0.9)
    if name != "dense":
        import commpress.ddp

        owner = {"momentum": momentum} if momentum else {"optimizer": opt}
        commpress.ddp.register(ddp, name, **owner, **options)

    def run(first: int, k: int) -> None:
        for step in range(first, first + k):
            loss = work.loss(ddp, step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    run(0, 3)
    dist.barrier()
    start = time.perf_counter()
    run(3, steps)
    dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            f.write(str(1e3 * (time.perf_counter() - start) / steps))
    dist.destroy_process_group()


def measure(case: str, steps: int) -> float:
    """ms per step of ``case`` (2 ranks, a fresh process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = f"/tmp/commpress_hook_overhead_{os.getpid()}.txt"
    mp.spawn(worker, args=(2, port, case, steps, out), nprocs=2)
    with open(out) as f:
        value = float(f.read())
    os.remove(out)
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=DEFAULT_CASES)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if "dense" not in args.cases:
        raise SystemExit("--cases must include dense (the baseline)")
    times: dict[str, list[float]] = {c: [] for c in args.cases}
    for r in range(args.rounds):
        for case in args.cases:
            times[case].append(measure(case, args.steps))
            print(f"round {r + 1}: {case}: {times[case][-1]:.1f} ms/step", flush=True)
    dense = statistics.median(times["dense"])
    print("\n| case | ms/step (median of rounds) | rounds | vs dense |\n|---|---|---|---|")
    for case, values in times.items():
        med = statistics.median(values)
        print(f"| `{case}` | {med:.1f} | {', '.join(f'{v:.1f}' for v in values)} | {med / dense:.3f}x |")


if __name__ == "__main__":
    main()
