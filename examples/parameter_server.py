"""The MPI parameter server: 1 server rank + 2 worker ranks, compressed push and pull.

Run (needs mpi4py and an MPI, e.g. ``pip install .[mpi]``)::

    mpirun -n 3 python examples/parameter_server.py             # 300 steps, ~20 s (mostly start-up)
    mpirun -n 3 python examples/parameter_server.py --steps 5   # smoke run

As root, or with fewer cores than ranks, add ``--oversubscribe`` and set
``OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``. Rank 0 holds the parameters and
the optimizer (SGD with momentum); each worker pushes top-k 5% gradients with error feedback and
pulls the server's 8-bit QSGD updates.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from commpress import ps


def main() -> None:
    """Describe the training as a ``ps.Task``, run it on every rank, report on rank 0."""
    parser = argparse.ArgumentParser(description="commpress parameter server under mpirun")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()

    # Synthetic task: a fixed random "teacher" labels Gaussian inputs (10 classes).
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(1))
    x_eval = torch.randn(2048, 32, generator=torch.Generator().manual_seed(2))
    y_eval = (x_eval @ teacher).argmax(1)

    def make_model() -> nn.Module:  # called on every rank after torch.manual_seed(config.seed)
        return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))

    def batch(worker: int, workers: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        # a pure function of its arguments: runs are reproducible and resumable
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1000 + step * workers + worker))
        return x, (x @ teacher).argmax(1)

    def loss(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(b[0]), b[1])

    def evaluate(model: nn.Module) -> dict[str, float]:  # rank 0, on the final parameters
        with torch.no_grad():
            return {"loss": loss(model, (x_eval, y_eval)).item()}

    task = ps.Task(model=make_model, loss=loss, batch=batch, evaluate=evaluate,
                   optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    # Push top-k 5% gradients; pull 8-bit QSGD updates (with the default pull codec, top-k too, this
    # small model's copies drift past max_drift=1% and most replies become dense resyncs).
    config = ps.PSConfig(servers=1, mode="sync", steps=args.steps, codec="topk:ratio=0.05",
                         pull_codec="qsgd:bits=8", progress=False)
    result = ps.run(task, config)  # every rank: rank 0 serves, ranks 1 and 2 work

    if result.rank == 0:
        torch.manual_seed(config.seed)
        first = evaluate(make_model())["loss"]  # the same initial model every rank started from
        per = result.stats["per_server"]  # one push and one reply per worker, step and server
        push = sum(s["push_bytes"] / max(s["push_msgs"], 1) for s in per)
        pull = sum(s["step_reply_bytes"] / max(s["step_reply_msgs"], 1) for s in per)
        print(f"stats: {result.steps_done} steps in {result.seconds:.1f} s, rejected {result.stats['rejected']}, "
              f"resyncs {result.stats['resyncs']}")
        print(f"done: loss {first:.3f} -> {result.metrics['loss']:.3f}, bytes/step per worker push {push:.0f} "
              f"pull {pull:.0f} (dense {4 * result.layout.numel})")
    ps.finish(result)  # ends the job if a dropped worker never exited


if __name__ == "__main__":
    main()
