"""Ranks for tests/test_integrations.py, run under torchrun like a user's training script.

``python -m torch.distributed.run --nproc-per-node 2 tests/integration_workers.py
<lightning|accelerate> <mode> <out>``: the real Lightning / Accelerate packages create the
process group from torchrun's environment. Modes: ``full`` trains 2N steps and checkpoints after
N; ``resume`` starts new processes from that checkpoint and trains the last N;
``lightning/dropped`` resumes from a checkpoint without the callback's entry and
``accelerate/unregistered`` loads the checkpoint before registering (the controls: both must
end elsewhere). Every rank writes ``<mode>_rank<r>.pt`` (final parameters and the hook's step;
Lightning: the ``commpress/*`` metrics the callback logged on it). Lightning ``full`` logs to a
CSVLogger in ``<out>/logs`` every LOG_EVERY steps (the callback's ``log_stats``).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

CODEC = {"lightning": ("topk", {"ratio": 0.05}), "accelerate": ("sign", {})}
STEPS = 8  # per half: checkpoint after STEPS, finish after 2 * STEPS
BATCH = 16
LOG_EVERY = 4  # Lightning's log_every_n_steps


class Net(nn.Module):
    """Two compressed weights (>= 1024 elements) and dense biases."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.hid = nn.Linear(64, 64)
        self.out = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hid(torch.relu(self.inp(x)))))


def data(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """STEPS batches of BATCH per rank (one epoch); the same tensors on every rank."""
    g = torch.Generator().manual_seed(7)
    n = STEPS * BATCH * world
    return torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def result(out: Path, mode: str, rank: int, model: nn.Module, step: int, metrics: dict | None = None) -> None:
    params = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    torch.save({"params": params, "step": step, "metrics": metrics or {}}, out / f"{mode}_rank{rank}.pt")


# ----- Lightning ---------------------------------------------------------------------------------
def run_lightning(mode: str, out: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader, TensorDataset

    from commpress.integrations.lightning import CompressionCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = Net()

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    world = int(os.environ["WORLD_SIZE"])
    codec, opts = CODEC["lightning"]
    callback = CompressionCallback(codec, **opts)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy="ddp", max_epochs=2, log_every_n_steps=LOG_EVERY,
        logger=CSVLogger(out / "logs", name="", version=0) if mode == "full" else False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[callback, ModelCheckpoint(dirpath=out / "ckpt", filename="{epoch}", every_n_epochs=1, save_top_k=-1)],
    )
    loader = DataLoader(TensorDataset(*data(world)), batch_size=BATCH, shuffle=False)
    module = Module()
    ckpt = {"full": None, "resume": out / "ckpt" / "epoch=0.ckpt", "dropped": out / "dropped.ckpt"}[mode]
    trainer.fit(module, loader, ckpt_path=ckpt, weights_only=True)
    assert callback.state is not None
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("commpress/")}
    result(out, mode, trainer.global_rank, module.net, callback.state.step, metrics)


# ----- Accelerate --------------------------------------------------------------------------------
def run_accelerate(mode: str, out: Path) -> None:
    from accelerate import Accelerator

    from commpress.integrations.accelerate import register

    accelerator = Accelerator(cpu=True)
    rank, world = accelerator.process_index, accelerator.num_processes
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ddp, opt = accelerator.prepare(model, opt)
    codec, opts = CODEC["accelerate"]
    if mode == "unregistered":  # the control: commpress's files are not read
        accelerator.load_state(str(out / "ckpt"))
    state = register(accelerator, ddp, codec, optimizer=opt, **opts)
    start = 0
    if mode == "resume":
        accelerator.load_state(str(out / "ckpt"))
    if mode != "full":
        start = STEPS
    x, y = data(world)
    for step in range(start, 2 * STEPS):
        i = (step % STEPS) * BATCH * world + rank * BATCH  # this rank's slice of the step's batch
        loss = F.cross_entropy(ddp(x[i : i + BATCH]), y[i : i + BATCH])
        opt.zero_grad()
        accelerator.backward(loss)
        opt.step()
        if mode == "full" and step == STEPS - 1:
            accelerator.save_state(str(out / "ckpt"))
    result(out, mode, rank, ddp.module, state.step)
    # free the DDP reducer before the process group goes: torch 2.13 otherwise aborts at exit now
    # and then ("terminate called without an active exception"; see ddp_workers._quiesce)
    del ddp, opt, state
    gc.collect()
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    framework, mode, out_dir = sys.argv[1:4]
    {"lightning": run_lightning, "accelerate": run_accelerate}[framework](mode, Path(out_dir))


def worker_gather(rank: int, world: int) -> None:
    """gather_states on spawned gloo ranks: rank 0 gets every rank's state, in rank order."""
    from commpress.integrations import ranks

    def state(r: int) -> dict:
        return {"rank": r, "res": {"w": torch.full((r + 1, 3), float(r))}, "empty": torch.zeros(0), "tag": "x" * r}

    got = ranks.gather_states(state(rank))
    if rank != 0:
        assert got is None
        return
    assert got is not None and len(got) == world
    for r, s in enumerate(got):
        want = state(r)
        assert s["rank"] == r and s["tag"] == want["tag"] and torch.equal(s["res"]["w"], want["res"]["w"])
        assert s["empty"].shape == (0,)
