"""Demo tasks for ``python -m commpress.ps``: real data, small models, deterministic batches.

* ``digits``: an MLP on scikit-learn's handwritten digits (8x8 images, 10 classes; the data
  ships with scikit-learn, nothing is downloaded). Metric: test accuracy in percent.
* ``bytelm``: a small causal transformer over bytes, trained on the Python standard
  library's own ``.py`` sources (read from ``sysconfig.get_paths()["stdlib"]``). Metric:
  validation bits per byte.

The models and data readers are the shared demo workloads (:mod:`commpress.demo.workloads`);
this module keeps only the parameter server's task glue. Each worker samples only from its
own part of the training data, and every batch is a pure function of ``(worker, workers,
step)``: runs are reproducible and resumable, and :func:`commpress.ps.reference_train` can
replay the union of the workers' batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..demo.workloads import (
    ByteLM,
    byte_tensor,
    digits_mlp,
    digits_split,
    seeded,
    stdlib_text,
    text_windows,
)
from .errors import ConfigError
from .runner import Task


def make_optimizer(name: str, lr: float, momentum: float = 0.9, weight_decay: float = 0.0
                   ) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """Factory for ``sgd`` (with momentum) or ``adam``, as a :class:`Task` wants it."""
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return lambda params: torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    raise ConfigError(f"optimizer must be sgd or adam, got {name!r}")


# ----- digits ----------------------------------------------------------------------------------
def _digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    try:
        return digits_split()
    except ImportError as exc:
        raise ConfigError(str(exc)) from None


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
        return digits_mlp(hidden)

    def batch(worker: int, workers: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x_train, y_train, _, _ = _digits()
        own = torch.arange(worker, len(y_train), workers)  # this worker's part of the data
        per_epoch = len(own) // batch_size
        epoch, i = divmod(step, per_epoch)
        order = own[torch.randperm(len(own), generator=seeded(seed, worker, epoch))]
        idx = order[i * batch_size : (i + 1) * batch_size]
        return x_train[idx], y_train[idx]

    def loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = b
        dev = next(m.parameters()).device
        return F.cross_entropy(m(x.to(dev)), y.to(dev))

    def evaluate(m: nn.Module) -> dict[str, float]:
        _, _, x_test, y_test = _digits()
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
        try:
            data = byte_tensor(stdlib_text(corpus_bytes))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        cut = int(len(data) * 0.9)
        return data[:cut], data[cut:]

    def model() -> nn.Module:
        return ByteLM(dim=width, layers=layers, context=context)

    def batch(worker: int, workers: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        train = splits()[0]
        part = len(train) // workers  # this worker's contiguous part of the corpus
        lo = worker * part
        starts = lo + torch.randint(0, part - context - 1, (batch_size,), generator=seeded(seed, worker, step))
        return text_windows(train, starts, context)

    def loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = b
        dev = next(m.parameters()).device
        logits = m(x.to(dev))
        return F.cross_entropy(logits.reshape(-1, 256), y.to(dev).reshape(-1))

    def evaluate(m: nn.Module) -> dict[str, float]:
        valid = splits()[1]
        starts = torch.linspace(0, len(valid) - context - 2, 64).long()  # fixed held-out windows
        x, y = text_windows(valid, starts, context)
        dev = next(m.parameters()).device
        nll = F.cross_entropy(m(x.to(dev)).reshape(-1, 256).cpu(), y.reshape(-1))
        return {"valid_bits_per_byte": float(nll) / math.log(2), "valid_loss": float(nll)}

    def merge(batches: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])

    return Task(model, loss, batch, make_optimizer(optimizer, lr, momentum), evaluate, merge)


DEMOS: dict[str, Callable[..., Task]] = {"digits": digits_task, "bytelm": bytelm_task}
