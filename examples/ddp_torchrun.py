"""Plain DDP with top-k 1% gradient compression, launched by torchrun (CPU, gloo).

Run::

    torchrun --nproc-per-node 2 examples/ddp_torchrun.py             # 300 steps, ~10 s on 2 CPU cores
    torchrun --nproc-per-node 2 examples/ddp_torchrun.py --steps 5   # smoke run

Run it again with the same ``--ckpt`` directory and it resumes: the model and optimizer from
rank 0's files, and each rank its own commpress state (residuals and momentum differ per rank).
"""

import argparse
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import commpress
import commpress.ddp


def main() -> None:
    """Train a small MLP on synthetic data with compressed DDP gradients."""
    parser = argparse.ArgumentParser(description="DDP + commpress top-k under torchrun")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ckpt", default="ckpt_ddp", help="checkpoint directory (resumed from if present)")
    args = parser.parse_args()

    # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT; the restartable form also works when
    # torchrun --max-restarts restarts the job (a plain init_process_group("gloo") does not: docs/long-runs.md)
    commpress.init_restartable_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    # Synthetic task: a fixed random "teacher" labels Gaussian inputs (10 classes).
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(1))
    x_eval = torch.randn(2048, 32, generator=torch.Generator().manual_seed(2))
    y_eval = (x_eval @ teacher).argmax(1)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return this rank's 64 examples of ``step`` (every rank sees different data)."""
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1000 + step * world + rank))
        return x, (x @ teacher).argmax(1)

    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))
    ddp_model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp_model.parameters(), lr=0.1, momentum=0.9)
    # Compress every >= 1024-element weight to its top 1% (biases stay dense). Without
    # optimizer=, commpress adopts `opt` after its first step and moves its momentum into the hook.
    # On this tiny model its divergence guard fires once early ("error-feedback residuals are
    # 21.9x ...: the next 50 steps are dense"): a logged safety net, not an error.
    state = commpress.ddp.register(ddp_model, "topk", ratio=0.01)

    os.makedirs(args.ckpt, exist_ok=True)
    state_file = os.path.join(args.ckpt, f"commpress-rank{rank}.cpst")  # one per rank
    if os.path.exists(state_file):  # resume
        model.load_state_dict(torch.load(os.path.join(args.ckpt, "model.pt"), weights_only=True))
        opt.load_state_dict(torch.load(os.path.join(args.ckpt, "optim.pt"), weights_only=True))
        state.load(state_file)
        if rank == 0:
            print(f"resumed from {args.ckpt} at step {state.step}")

    def eval_loss() -> float:
        with torch.no_grad():
            return F.cross_entropy(model(x_eval), y_eval).item()

    first = eval_loss()
    start = state.step
    for step in range(start, start + args.steps):
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(ddp_model(x), y).backward()  # the hook compresses and averages gradients
        opt.step()
    last = eval_loss()

    state.save(state_file)  # residuals, momentum, step, counters of this rank
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(args.ckpt, "model.pt"))
        torch.save(opt.state_dict(), os.path.join(args.ckpt, "optim.pt"))
        s = state.stats()
        print(f"stats: steps {s['steps']}, compression x{s['compression_ratio']:.1f}, "
              f"wire x{s['wire_ratio']:.1f}, encode {s['encode_s']:.3f} s, decode {s['decode_s']:.3f} s")
        print(f"done: loss {first:.3f} -> {last:.3f}, bytes/step {s['bytes_sent_per_step']:.0f} "
              f"(dense {s['dense_bytes_per_step']:.0f})")

    # Free the DDP model before the process group goes (avoids a rare abort at exit).
    del ddp_model, state, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
