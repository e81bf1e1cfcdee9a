"""The torchrun recipe of the elastic tests (``torchrun ... tests/elastic_workers.py --ckpt DIR ...``).

The README's and ``examples/ddp_torchrun.py``'s loop, with a checkpoint every ``--every`` steps
and a resume at start when one exists: the model and optimizer through the user's
``torch.save`` (rank 0), each rank's commpress state through ``state.save``. A checkpoint is
a directory ``step-NNNNNN`` that counts only once every rank has written its part: after a
barrier rank 0 replaces ``latest`` (an atomic write naming the directory), so a rank killed
halfway through a save leaves the previous ``latest`` in force.

``--kill-rank R --kill-at K`` sends SIGKILL to rank R just before step K, in the first
attempt only (``TORCHELASTIC_RESTART_COUNT`` is 0): torchrun then restarts every rank, which
resume from ``latest``. Each attempt appends one JSON line to ``DIR/attempts-rankR.jsonl``
(attempt, the step it resumed from); at the end every rank writes its flat parameters to
``DIR/final-rankR.pt``.

``--world-check`` additionally all-gathers a parameter digest at the end and fails unless
every rank agrees.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import commpress  # noqa: E402
import commpress.ddp  # noqa: E402
from commpress.checkpoint import write_private  # noqa: E402
from commpress.optim import DivergenceGuard  # noqa: E402


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's 32 examples of ``step``: a fixed random teacher labels Gaussian inputs."""
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(1))
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(1000 + step * world + rank))
    return x, (x @ teacher).argmax(1)


def parse_spec(spec: str) -> tuple[str, dict[str, object]]:
    """``"topk:ratio=0.01,warmup_steps=0"`` -> ``("topk", {"ratio": 0.01, "warmup_steps": 0})``."""
    name, _, rest = spec.partition(":")
    opts: dict[str, object] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        opts[key] = json.loads(value) if value[:1].isdigit() or value in ("true", "false") else value
    return name, opts


def main() -> None:
    """Train, checkpointing every ``--every`` steps, resuming from ``latest`` if present."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--codec", default="topk:ratio=0.01")
    parser.add_argument("--optimizer-arg", action="store_true", help="register(..., optimizer=opt) as in the README")
    parser.add_argument("--guard-threshold", type=float, default=None,
                        help="a divergence guard measuring every 3 steps, 5 dense steps when it fires")
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-at", type=int, default=-1)
    args = parser.parse_args()

    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    commpress.init_restartable_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = Path(args.ckpt)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    name, opts = parse_spec(args.codec)
    if args.optimizer_arg:
        opts["optimizer"] = opt
    if args.guard_threshold is not None:
        opts["divergence_guard"] = DivergenceGuard(interval=3, threshold=args.guard_threshold, dense_steps=5)
    state = commpress.ddp.register(ddp, name, **opts)  # type: ignore[arg-type]

    start = 0
    latest = ckpt / "latest"
    if latest.exists():
        where = ckpt / latest.read_text().strip()
        model.load_state_dict(torch.load(where / "model.pt", weights_only=True))
        opt.load_state_dict(torch.load(where / "optim.pt", weights_only=True))
        state.load(str(where / f"commpress-rank{rank}.cpst"))
        start = state.step
    with open(ckpt / f"attempts-rank{rank}.jsonl", "a") as f:
        f.write(json.dumps({"attempt": attempt, "resumed_from": start}) + "\n")

    for step in range(start, args.steps):
        if attempt == 0 and rank == args.kill_rank and step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(step, rank, world)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        done = step + 1
        if done % args.every == 0 and done < args.steps:
            where = ckpt / f"step-{done:06d}"
            where.mkdir(exist_ok=True)
            if rank == 0:
                torch.save(model.state_dict(), where / "model.pt")
                torch.save(opt.state_dict(), where / "optim.pt")
            state.save(str(where / f"commpress-rank{rank}.cpst"))
            dist.barrier()  # every rank's part is on disk: only now does the checkpoint count
            if rank == 0:
                write_private(str(latest), where.name.encode())

    torch.save(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), ckpt / f"final-rank{rank}.pt")
    (ckpt / f"stats-rank{rank}.json").write_text(json.dumps(state.stats()))
    del ddp, state, opt
    gc.collect()  # free the DDP reducer before the process group goes (see ddp_workers._quiesce)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()


# ----- world-size change (spawned ranks, through ddp_workers.launch) -----------------------------
RESIZE_STEPS = 6  # steps trained at the first world size before the save
RESIZE_CODEC: dict[str, object] = {"ratio": 0.05, "warmup_steps": 0}


def _resize_model() -> tuple[nn.Module, nn.parallel.DistributedDataParallel, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    return model, ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)


def resize_save(rank: int, world: int, root: str, algorithms: list[str]) -> None:
    """For each algorithm: train ``RESIZE_STEPS`` steps at ``world`` ranks, save as the recipe does (a file per rank)."""
    for algorithm in algorithms:
        out = os.path.join(root, algorithm)
        if rank == 0:
            os.makedirs(out, exist_ok=True)
        dist.barrier()
        _resize_save(rank, world, out, algorithm)
        gc.collect()


def _resize_save(rank: int, world: int, out: str, algorithm: str) -> None:
    model, ddp, opt = _resize_model()
    state = commpress.ddp.register(ddp, "topk", optimizer=opt, algorithm=algorithm, **RESIZE_CODEC)  # type: ignore[arg-type]
    for step in range(RESIZE_STEPS):
        x, y = batch(step, rank, world)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    state.save(os.path.join(out, f"commpress-rank{rank}.cpst"))
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(out, "model.pt"))
        torch.save(opt.state_dict(), os.path.join(out, "optim.pt"))
        Path(out, "saved.json").write_text(json.dumps({
            "stats": state.stats(), "guard": state.guard.state(), "rules": sorted(state.momentum_rules),
        }))
    del ddp, state


def resize_load(rank: int, world: int, root: str, algorithms: list[str], saved_world: int) -> None:
    """For each algorithm: load what :func:`resize_save` wrote at ``saved_world`` ranks, record what happened, train on."""
    for algorithm in algorithms:
        _resize_load(rank, world, os.path.join(root, algorithm), algorithm, saved_world)
        gc.collect()


def _resize_load(rank: int, world: int, out: str, algorithm: str, saved_world: int) -> None:
    import logging

    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                records.append(record.getMessage())

    handler = _Keep()
    logging.getLogger("commpress").addHandler(handler)
    model, ddp, opt = _resize_model()
    state = commpress.ddp.register(ddp, "topk", optimizer=opt, algorithm=algorithm, **RESIZE_CODEC)  # type: ignore[arg-type]
    model.load_state_dict(torch.load(os.path.join(out, "model.pt"), weights_only=True))
    opt.load_state_dict(torch.load(os.path.join(out, "optim.pt"), weights_only=True))
    records.clear()  # only what the load says
    mine = os.path.join(out, f"commpress-rank{rank}.cpst")
    path = mine if rank < saved_world else os.path.join(out, "commpress-rank0.cpst")  # a new rank: any file
    result: dict[str, object] = {"rank": rank}
    try:
        state.load(path)
    except Exception as exc:  # noqa: BLE001 - the test reads what a load does today
        result["error"] = f"{type(exc).__name__}: {exc}"
    logging.getLogger("commpress").removeHandler(handler)
    result.update({
        "warnings": list(records), "step": state.step, "stats": state.stats(), "guard": state.guard.state(),
        "rules": sorted(state.momentum_rules), "velocities": len(state.velocity),
        "residuals": sum(state.residual(n) is not None for n in state.plans),
    })
    if "error" not in result:
        for step in range(state.step, state.step + 3):  # training goes on at the new size
            x, y = batch(step, rank, world)
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        result["after_step"] = state.step
        from ddp_workers import digest
        digests = [None] * world
        dist.all_gather_object(digests, digest(model))
        result["same_across_ranks"] = len(set(digests)) == 1
    Path(out, f"loaded-{world}-rank{rank}.json").write_text(json.dumps(result))
    del ddp, state
