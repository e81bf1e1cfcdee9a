"""Demo tasks for ``python -m commpress.ps``: real data, small models, deterministic batches.

* ``digits``: an MLP on scikit-learn's handwritten digits (8x8 images, 10 classes; the data
  ships with scikit-learn, nothing is downloaded). Metric: test accuracy in percent.
* ``bytelm``: a small causal transformer over bytes, trained on the Python standard
  library's own ``.py`` sources (read from ``sysconfig.get_paths()["stdlib"]``). Metric:
  validation bits per byte.

Each worker samples only from its own part of the training data, and every batch is a pure
function of ``(worker, workers, step)``: runs are reproducible and resumable, and
:func:`commpress.ps.reference_train` can replay the union of the workers' batches.
"""

from __future__ import annotations

import glob
import importlib.util
import math
import os
import sysconfig
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .errors import ConfigError
from .runner import Task


def _generator(*seed: int) -> torch.Generator:
    g = torch.Generator()
    h = 0
    for s in seed:
        h = (h * 1_000_003 + s + 0x9E3779B9) % (1 << 62)
    g.manual_seed(h)
    return g


def make_optimizer(name: str, lr: float, momentum: float = 0.9, weight_decay: float = 0.0
                   ) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """Factory for ``sgd`` (with momentum) or ``adam``, as a :class:`Task` wants it."""
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return lambda params: torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    raise ConfigError(f"optimizer must be sgd or adam, got {name!r}")


# ----- digits ----------------------------------------------------------------------------------
def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    # Read the CSV that scikit-learn ships instead of importing scikit-learn (and SciPy):
    # that saves about a second of start-up on every rank. Same data as load_digits().
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the digits demo needs scikit-learn (pip install scikit-learn)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "datasets", "data", "digits.csv.gz")
    if not os.path.exists(path):  # another layout: ask scikit-learn itself
        from sklearn.datasets import load_digits

        d = load_digits()
        return d.data, d.target
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1], data[:, -1].astype(np.int64)


@lru_cache(maxsize=1)
def digits_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)``: 1437 / 360 images, pixels scaled to [0, 1]."""
    images, labels = _load_digits()
    x = torch.tensor(images, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=_generator(1234))
    x, y = x[perm], y[perm]
    n_test = 360
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


def digits_task(
    batch_size: int = 32,
    hidden: int = 128,
    optimizer: str = "sgd",
    lr: float | None = None,
    momentum: float = 0.9,
    seed: int = 0,
) -> Task:
    """MLP 64 -> ``hidden`` -> 10 on the digits; ``batch_size`` per worker per step.

    The data is loaded on first use (servers other than rank 0 never load it).
    """
    lr = lr if lr is not None else (0.05 if optimizer == "sgd" else 2e-3)

    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def batch(worker: int, workers: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x_train, y_train, _, _ = digits_data()
        own = torch.arange(worker, len(y_train), workers)  # this worker's part of the data
        per_epoch = len(own) // batch_size
        epoch, i = divmod(step, per_epoch)
        order = own[torch.randperm(len(own), generator=_generator(seed, worker, epoch))]
        idx = order[i * batch_size : (i + 1) * batch_size]
        return x_train[idx], y_train[idx]

    def loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = b
        dev = next(m.parameters()).device
        return F.cross_entropy(m(x.to(dev)), y.to(dev))

    def evaluate(m: nn.Module) -> dict[str, float]:
        _, _, x_test, y_test = digits_data()
        dev = next(m.parameters()).device
        logits = m(x_test.to(dev)).cpu()
        return {
            "test_accuracy": float((logits.argmax(1) == y_test).float().mean()) * 100.0,
            "test_loss": float(F.cross_entropy(logits, y_test)),
        }

    def merge(batches: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])

    return Task(model, loss, batch, make_optimizer(optimizer, lr, momentum), evaluate, merge)


# ----- byte-level language model -------------------------------------------------------------
@lru_cache(maxsize=4)
def stdlib_corpus(max_bytes: int = 1 << 20) -> bytes:
    """Up to ``max_bytes`` of the standard library's top-level ``.py`` files, in name order."""
    root = sysconfig.get_paths()["stdlib"]
    chunks: list[bytes] = []
    total = 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    corpus = b"".join(chunks)[:max_bytes]
    if len(corpus) < 10_000:
        raise ConfigError(f"found only {len(corpus)} bytes of Python sources under {root}")
    return corpus


class ByteLM(nn.Module):
    """A small causal transformer over bytes (pre-norm, learned positions, no dropout)."""

    def __init__(self, context: int = 64, width: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(256, width)
        self.pos = nn.Parameter(torch.randn(context, width) * 0.02)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits for the next byte at every position of ``tokens`` (batch, time)."""
        t = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device)
        h = self.embed(tokens) + self.pos[:t]
        h = self.blocks(h, mask=mask, is_causal=True)
        return self.head(self.norm(h))


def bytelm_task(
    batch_size: int = 16,
    context: int = 64,
    width: int = 64,
    layers: int = 2,
    optimizer: str = "adam",
    lr: float | None = None,
    momentum: float = 0.9,
    corpus_bytes: int = 1 << 20,
    seed: int = 0,
) -> Task:
    """Byte-level LM on stdlib sources; the last 10% of the corpus is held out."""
    lr = lr if lr is not None else (3e-3 if optimizer == "adam" else 0.1)

    @lru_cache(maxsize=1)
    def splits() -> tuple[torch.Tensor, torch.Tensor]:
        data = torch.frombuffer(bytearray(stdlib_corpus(corpus_bytes)), dtype=torch.uint8).long()
        cut = int(len(data) * 0.9)
        return data[:cut], data[cut:]

    def model() -> nn.Module:
        return ByteLM(context, width, layers)

    def windows(src: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + torch.arange(context + 1)[None, :]
        chunk = src[idx]
        return chunk[:, :-1], chunk[:, 1:]

    def batch(worker: int, workers: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        train = splits()[0]
        part = len(train) // workers  # this worker's contiguous part of the corpus
        lo = worker * part
        starts = lo + torch.randint(0, part - context - 1, (batch_size,), generator=_generator(seed, worker, step))
        return windows(train, starts)

    def loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = b
        dev = next(m.parameters()).device
        logits = m(x.to(dev))
        return F.cross_entropy(logits.reshape(-1, 256), y.to(dev).reshape(-1))

    def evaluate(m: nn.Module) -> dict[str, float]:
        valid = splits()[1]
        starts = torch.linspace(0, len(valid) - context - 2, 64).long()  # fixed held-out windows
        x, y = windows(valid, starts)
        dev = next(m.parameters()).device
        nll = F.cross_entropy(m(x.to(dev)).reshape(-1, 256).cpu(), y.reshape(-1))
        return {"valid_bits_per_byte": float(nll) / math.log(2), "valid_loss": float(nll)}

    def merge(batches: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])

    return Task(model, loss, batch, make_optimizer(optimizer, lr, momentum), evaluate, merge)


DEMOS: dict[str, Callable[..., Task]] = {"digits": digits_task, "bytelm": bytelm_task}
