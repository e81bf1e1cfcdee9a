"""PyTorch Lightning DDP with top-k 1% gradient compression: one callback (CPU, gloo).

Run::

    torchrun --nproc-per-node 2 examples/lightning_ddp.py             # 200 steps, ~15 s
    torchrun --nproc-per-node 2 examples/lightning_ddp.py --steps 5   # smoke run
    python examples/lightning_ddp.py --steps 5                        # Lightning starts rank 1 itself

``CompressionCallback`` registers commpress on the strategy's DDP model when ``fit`` starts
(with the optimizer from ``configure_optimizers``: its SGD momentum moves into the hook), and
puts every rank's compression state into Lightning's checkpoints.
"""

import argparse
import logging

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from commpress.integrations.lightning import CompressionCallback


class Classifier(pl.LightningModule):
    """A small MLP; Lightning wraps it in DDP and runs the loop."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Cross-entropy of one batch (the callback's hook compresses its gradients)."""
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """The user's SGD with momentum."""
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main() -> None:
    """Train on synthetic data with the compression callback; print loss and bytes on rank 0."""
    parser = argparse.ArgumentParser(description="Lightning DDP + commpress")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # quieter start-up

    # Synthetic task: a fixed random "teacher" labels Gaussian inputs (10 classes).
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(1))
    x = torch.randn(args.steps * 64 * 2, 32, generator=torch.Generator().manual_seed(3))
    loader = DataLoader(TensorDataset(x, (x @ teacher).argmax(1)), batch_size=64)  # DDP shards it per rank
    x_eval = torch.randn(2048, 32, generator=torch.Generator().manual_seed(2))
    y_eval = (x_eval @ teacher).argmax(1)

    torch.manual_seed(0)
    module = Classifier()
    with torch.no_grad():
        first = F.cross_entropy(module.net(x_eval), y_eval).item()

    callback = CompressionCallback("topk", ratio=0.01)  # the options of commpress.ddp.register
    trainer = pl.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_steps=args.steps, callbacks=[callback],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, loader)

    with torch.no_grad():
        last = F.cross_entropy(module.net(x_eval), y_eval).item()
    if trainer.global_rank == 0:
        assert callback.state is not None  # this rank's commpress.ddp.CompressionState
        s = callback.state.stats()
        print(f"stats: steps {s['steps']}, compression x{s['compression_ratio']:.1f}, "
              f"encode {s['encode_s']:.3f} s, decode {s['decode_s']:.3f} s")
        print(f"done: loss {first:.3f} -> {last:.3f}, bytes/step {s['bytes_sent_per_step']:.0f} "
              f"(dense {s['dense_bytes_per_step']:.0f})")


if __name__ == "__main__":
    main()
