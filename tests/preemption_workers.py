"""Ranks of the preemption test, one process each (``python tests/preemption_workers.py PHASE RANK ...``).

Own processes rather than ``mp.spawn``, so the test reads each rank's exit code. Phases:
``preempt`` installs the handler and sends SIGTERM to rank ``signal_rank`` before step
``signal_at`` (the handler saves on every rank and exits with its code); ``resume`` first trains
``total`` steps uninterrupted (fresh model, optimizer and state: the reference), then fresh ones
again load what ``preempt`` saved and train to ``total``; ``full`` is the reference alone. Both
write their final parameters for the test to compare. ``kind`` ``ddp`` saves per-rank files
(``torch.save`` + ``state.save``), ``fsdp`` one ``torch.distributed.checkpoint`` of model,
optimizer and commpress state (``state.dcp()``), as FSDP users checkpoint.
"""

from __future__ import annotations

import datetime
import gc
import io
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import commpress  # noqa: E402
import commpress.ddp  # noqa: E402
from commpress.checkpoint import write_private  # noqa: E402

from ddp_workers import COLLECTIVE_TIMEOUT_S, batch, flat_params, make_ddp, train_step  # noqa: E402


def _loop(phase: str, rank: int, state: Any, save: Callable[[int], None], steps: range, signal_rank: int,
          signal_at: int, step_fn: Callable[[int], None], installed: list[Any]) -> None:
    """Train ``steps``; ``preempt``: with the handler installed (appended to ``installed``, for
    ``save``) and SIGTERM to ``signal_rank`` before ``signal_at``."""
    handler = commpress.install_preemption_handler(state, save) if phase == "preempt" else None
    installed.append(handler)
    for step in steps:
        if handler is not None and rank == signal_rank and step == signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        step_fn(step)
    if handler is not None:
        raise SystemExit(f"rank {rank}: trained to the end, the handler never stopped it")


def train(phase: str, rank: int, out: Path, total: int, signal_rank: int, signal_at: int) -> None:
    ddp = make_ddp()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    state = commpress.ddp.register(ddp, "topk", ratio=0.05, optimizer=opt)
    start = 0
    if phase == "resume":
        ckpt = torch.load(out / f"ckpt-rank{rank}.pt", weights_only=True)
        ddp.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optim"])
        state.load(str(out / f"commpress-rank{rank}.cpst"))
        start = int(ckpt["step"])

    installed: list[Any] = []

    def save(step: int) -> None:
        buf = io.BytesIO()
        torch.save({"model": ddp.module.state_dict(), "optim": opt.state_dict(), "step": step}, buf)
        write_private(str(out / f"ckpt-rank{rank}.pt"), buf.getvalue())  # atomic, like state.save
        state.save(str(out / f"commpress-rank{rank}.cpst"))
        (out / f"saved-rank{rank}.json").write_text(json.dumps({"step": step, "signalled": installed[0].signalled}))

    _loop(phase, rank, state, save, range(start, total), signal_rank, signal_at,
          lambda step: train_step(ddp, opt, rank, step), installed)
    torch.save(flat_params(ddp), out / f"final-{phase}-rank{rank}.pt")


def train_fsdp(phase: str, rank: int, out: Path, total: int, signal_rank: int, signal_at: int) -> None:
    """The same run on FSDP2: top-k with the user's SGD momentum, saved with ``dcp.save`` on preemption."""
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import commpress.fsdp

    from fsdp_workers import full_params, make_fsdp

    model = make_fsdp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # preempted as a newcomer registers (no optimizer=: the state finds it at its first
    # reduce-scatter, the handler counts the first optimizer to step); a resume that loads
    # velocities names it, and the uninterrupted reference with it must be the same run bit for bit
    state = commpress.fsdp.register(model, "topk", ratio=0.05, **({} if phase == "preempt" else {"optimizer": opt}))

    def checkpoint() -> dict:
        model_sd, optim_sd = get_state_dict(model, opt)
        return {"model": model_sd, "optim": optim_sd, "commpress": state.dcp()}

    start = 0
    if phase == "resume":
        sd = checkpoint()
        dcp.load(sd, checkpoint_id=str(out / "dcp"))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        start = json.loads((out / f"saved-rank{rank}.json").read_text())["step"]

    installed: list[Any] = []

    def save(step: int) -> None:
        dcp.save(checkpoint(), checkpoint_id=str(out / "dcp"))  # every rank: one checkpoint of the job
        (out / f"saved-rank{rank}.json").write_text(json.dumps({"step": step, "signalled": installed[0].signalled}))

    def train_step_fsdp(step: int) -> None:
        x, y = batch(rank, step)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    _loop(phase, rank, state, save, range(start, total), signal_rank, signal_at, train_step_fsdp, installed)
    params = full_params(model)  # a collective: every rank
    torch.save(params, out / f"final-{phase}-rank{rank}.pt")


def main(phase: str, rank: int, world: int, init_file: str, outdir: str, total: int, signal_rank: int, signal_at: int,
         kind: str = "ddp") -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    run = {"ddp": train, "fsdp": train_fsdp}[kind]
    if phase == "resume":  # the uninterrupted reference first, in objects of its own: two launches fewer
        run("full", rank, Path(outdir), total, signal_rank, signal_at)
        gc.collect()
    run(phase, rank, Path(outdir), total, signal_rank, signal_at)
    gc.collect()  # free the DDP reducer before the process group goes (see ddp_workers._quiesce)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    p, r, w, f, o, n, sr, sa = sys.argv[1:9]
    main(p, int(r), int(w), f, o, int(n), int(sr), int(sa), *sys.argv[9:10])
