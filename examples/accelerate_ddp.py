"""Hugging Face Accelerate with top-k 1% gradient compression, launched by torchrun (CPU, gloo).

Run::

    torchrun --nproc-per-node 2 examples/accelerate_ddp.py                     # 300 steps, ~10 s
    torchrun --nproc-per-node 2 examples/accelerate_ddp.py --steps 5 --ckpt c  # smoke run + save_state

One call after ``accelerator.prepare``: ``register`` puts the commpress hook on the DDP model
Accelerate built, and makes ``accelerator.save_state`` / ``load_state`` carry every rank's
compression state (``<dir>/commpress_rank<r>.pt``).
"""

import argparse
import gc

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from commpress.integrations.accelerate import register


def main() -> None:
    """Train a small MLP on synthetic data; print loss and bytes on the main process."""
    parser = argparse.ArgumentParser(description="Accelerate + commpress")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ckpt", default=None, help="directory for accelerator.save_state at the end")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True)  # reads torchrun's environment, creates the gloo group
    world = accelerator.num_processes

    # Synthetic task: a fixed random "teacher" labels Gaussian inputs (10 classes).
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(1))
    x = torch.randn(args.steps * 64 * world, 32, generator=torch.Generator().manual_seed(3))
    loader = DataLoader(TensorDataset(x, (x @ teacher).argmax(1)), batch_size=64)
    x_eval = torch.randn(2048, 32, generator=torch.Generator().manual_seed(2))
    y_eval = (x_eval @ teacher).argmax(1)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ddp_model, opt, loader = accelerator.prepare(model, opt, loader)  # loader: a shard per process
    state = register(accelerator, ddp_model, "topk", optimizer=opt, ratio=0.01)  # after prepare

    def eval_loss() -> float:
        with torch.no_grad():
            return F.cross_entropy(model(x_eval), y_eval).item()

    first = eval_loss()
    for x_b, y_b in loader:  # args.steps batches per process
        opt.zero_grad()
        accelerator.backward(F.cross_entropy(ddp_model(x_b), y_b))
        opt.step()
    last = eval_loss()

    if args.ckpt:
        accelerator.save_state(args.ckpt)  # + commpress_rank<r>.pt on every rank; load_state restores
    if accelerator.is_main_process:
        s = state.stats()
        print(f"stats: steps {s['steps']}, compression x{s['compression_ratio']:.1f}, "
              f"encode {s['encode_s']:.3f} s, decode {s['decode_s']:.3f} s")
        print(f"done: loss {first:.3f} -> {last:.3f}, bytes/step {s['bytes_sent_per_step']:.0f} "
              f"(dense {s['dense_bytes_per_step']:.0f})")

    # Free the DDP model before the process group goes (avoids a rare abort at exit).
    del ddp_model, opt, state
    gc.collect()
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
