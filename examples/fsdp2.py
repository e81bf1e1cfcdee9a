"""FSDP2 (``fully_shard``) with commpress's recommended setting, under torchrun (CPU, gloo).

Run::

    torchrun --nproc-per-node 2 examples/fsdp2.py             # 60 steps, ~10 s on 2 CPU cores
    torchrun --nproc-per-node 2 examples/fsdp2.py --steps 5   # smoke run

The recommended setting compresses all three volumes of a sharded step: the forward all-gather
sends block-scaled int8 weights, the backward all-gather reuses the forward's frames (no bytes),
and the gradient reduce-scatter sends 2-bit QSGD. See docs/fsdp.md.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

import commpress.fsdp


class Net(nn.Module):
    """A small residual MLP: an input layer, three blocks (each its own FSDP unit), a head."""

    def __init__(self, dim: int = 128) -> None:
        super().__init__()
        self.inp = nn.Linear(32, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(3))
        self.out = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for ``x`` (batch x 32)."""
        h = torch.relu(self.inp(x))
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def main() -> None:
    """Shard the model, register commpress, train on synthetic data, print loss and bytes."""
    parser = argparse.ArgumentParser(description="FSDP2 + commpress under torchrun")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()

    dist.init_process_group("gloo")  # torchrun's environment; FSDP2 runs on CPU with gloo
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank before sharding

    # Synthetic task: a fixed random "teacher" labels Gaussian inputs (10 classes).
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(1))
    x_eval = torch.randn(1024, 32, generator=torch.Generator().manual_seed(2))
    y_eval = (x_eval @ teacher).argmax(1)

    model = Net()
    for block in model.blocks:  # one FSDP unit per block, then the root (input layer and head)
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    state = commpress.fsdp.register(
        model, "qsgd", bits=2,                                # 2-bit QSGD reduce-scatter (unbiased)
        param_codec={"forward": "int8", "backward": "reuse"},  # int8 forward gather, none backward
        optimizer=opt,
    )

    def eval_loss() -> float:
        with torch.no_grad():  # every rank runs the forward: FSDP all-gathers the shards
            return F.cross_entropy(model(x_eval), y_eval).item()

    first = eval_loss()
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1000 + step * world + rank))
        opt.zero_grad()
        F.cross_entropy(model(x), (x @ teacher).argmax(1)).backward()
        opt.step()  # AdamW steps on this rank's shard
    last = eval_loss()

    s = state.stats()
    if rank == 0:
        steps = max(s["steps"], 1)
        print(f"stats: reduce-scatter x{s['compression_ratio']:.1f} fewer bytes, all-gather "
              f"x{s['allgather_compression_ratio']:.1f}, compression state {s['compression_state_bytes']:.0f} B")
        print(f"done: loss {first:.3f} -> {last:.3f}, bytes/step reduce-scatter {s['bytes_sent_per_step']:.0f} "
              f"(FSDP {s['dense_bytes_per_step']:.0f}), all-gather {s['allgather_bytes_sent'] / steps:.0f} "
              f"(FSDP {s['allgather_dense_bytes'] / steps:.0f})")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
