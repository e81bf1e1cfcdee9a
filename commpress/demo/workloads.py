"""Models and real data shared by the demos and benchmarks (no downloads).

- Text: the source files of Python's own standard library, read in sorted order, as bytes.
- Digits: scikit-learn's bundled 8x8 handwritten digits (1797 images).
"""

from __future__ import annotations

import os
import sysconfig

import torch
from torch import nn


def stdlib_text(limit: int) -> bytes:
    """Deterministic real text: the standard library's .py sources, in sorted order."""
    root = sysconfig.get_paths()["stdlib"]
    out = bytearray()
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            with open(os.path.join(root, name), "rb") as f:
                out += f.read()
            if len(out) >= limit:
                break
    return bytes(out[:limit])


class ByteLM(nn.Module):
    """A small causal transformer over bytes."""

    def __init__(self, dim: int = 128, layers: int = 2, context: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, batch_first=True, dropout=0.0)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 256)
        self.mask: torch.Tensor
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Next-byte logits for every position of ``x`` (batch, length)."""
        n = x.shape[1]
        h = self.embed(x) + self.pos[:n]
        return self.head(self.blocks(h, mask=self.mask[:n, :n], is_causal=True))


class TextBatches:
    """Batches of byte windows: a training stream per rank and a fixed held-out set."""

    def __init__(self, context: int = 64, nbytes: int = 2_000_000, holdout: int = 200_000) -> None:
        data = torch.frombuffer(bytearray(stdlib_text(nbytes)), dtype=torch.uint8).long()
        self.train, self.test = data[:-holdout], data[-holdout:]
        self.context = context

    def _windows(self, data: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq = torch.stack([data[s : s + self.context + 1] for s in starts.tolist()])
        return seq[:, :-1], seq[:, 1:]

    def batch(self, step: int, rank: int, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The training batch of ``rank`` at ``step`` (deterministic, disjoint across ranks)."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 4099 + rank)
        return self._windows(self.train, torch.randint(0, self.train.numel() - self.context - 1, (batch,), generator=g))

    def heldout(self, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
        """A fixed held-out batch for evaluation."""
        starts = torch.linspace(0, self.test.numel() - self.context - 2, n).long()
        return self._windows(self.test, starts)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats)."""
    return nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))


def wide_mlp(width: int = 4096, depth: int = 2) -> nn.Module:
    """A communication-heavy MLP for 8x8 digits: ~17M parameters at width 4096, depth 2."""
    layers: list[nn.Module] = [nn.Linear(64, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits as (float32 images scaled to [0, 1], int64 labels)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    return torch.tensor(d.data / 16.0, dtype=torch.float32), torch.tensor(d.target, dtype=torch.int64)
