"""The one set of demo workloads: models and real-data readers (no downloads).

Every demo and benchmark trains these: ``commpress train`` and ``scripts/bench_e2e.py`` (via
:mod:`.runner`), ``scripts/ddp_convergence.py``, ``scripts/demo_codecs.py`` and the parameter
server demos (:mod:`commpress.ps.demos`, which adds only its per-worker batch glue). One
reader per data set and one builder per model family, so a number in one table and the same
workload in another are the same thing.

- Text: the source files of Python's own standard library, in sorted order, as bytes
  (:func:`stdlib_text`), cut into next-byte windows (:func:`text_windows`, :class:`TextBatches`)
  for a causal transformer over bytes (:class:`ByteLM`, :func:`lm_loss`).
- Digits: scikit-learn's bundled 8x8 handwritten digits (1797 images; :func:`digits_arrays`),
  one fixed train/test split (:func:`digits_split`) and MLPs over them (:func:`digits_mlp`).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sysconfig
from functools import lru_cache

import numpy as np
import torch
from torch import nn

DIGITS_TEST = 360  # held-out digits images
DIGITS_SPLIT_SEED = 1234


def seeded(*seed: int) -> torch.Generator:
    """A generator seeded from a tuple of ints (e.g. ``(seed, worker, step)``), stable across runs."""
    g = torch.Generator()
    h = 0
    for s in seed:
        h = (h * 1_000_003 + s + 0x9E3779B9) % (1 << 62)
    g.manual_seed(h)
    return g


# ----- text --------------------------------------------------------------------------------------
@lru_cache(maxsize=4)
def stdlib_text(limit: int) -> bytes:
    """Deterministic real text: up to ``limit`` bytes of the standard library's top-level ``.py`` files, in name order."""
    root = sysconfig.get_paths()["stdlib"]
    out = bytearray()
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as f:
            out += f.read()
        if len(out) >= limit:
            break
    if len(out) < min(limit, 10_000):
        raise ValueError(f"found only {len(out)} bytes of Python sources under {root}")
    return bytes(out[:limit])


def byte_tensor(data: bytes) -> torch.Tensor:
    """``data`` as an int64 tensor of byte values (the LM's tokens)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def text_windows(data: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets (each ``(len(starts), context)``) of the windows at ``starts``."""
    chunk = data[starts[:, None] + torch.arange(context + 1)[None, :]]
    return chunk[:, :-1], chunk[:, 1:]


class TextBatches:
    """Random byte windows of the stdlib text: a training stream per rank and a fixed held-out set.

    The last ``holdout`` bytes of the first ``nbytes`` are held out. Used by the DDP demo and
    the end-to-end benchmark (the parameter server samples its own per-worker parts).
    """

    def __init__(self, context: int = 64, nbytes: int = 2_000_000, holdout: int = 200_000) -> None:
        if context < 1 or holdout <= context + 1 or nbytes <= holdout + context + 1:
            raise ValueError(f"need context >= 1 and nbytes > holdout > context + 1, got {context=}, {nbytes=}, {holdout=}")
        data = byte_tensor(stdlib_text(nbytes))
        self.train, self.test = data[:-holdout], data[-holdout:]
        self.context = context

    def batch(self, step: int, rank: int, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The training batch of ``rank`` at ``step`` (deterministic; ranks draw independently)."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 4099 + rank)
        starts = torch.randint(0, self.train.numel() - self.context - 1, (batch,), generator=g)
        return text_windows(self.train, starts, self.context)

    def heldout(self, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` fixed windows spread evenly over the held-out text."""
        starts = torch.linspace(0, self.test.numel() - self.context - 2, n).long()
        return text_windows(self.test, starts, self.context)


class ByteLM(nn.Module):
    """A causal transformer over bytes (post-norm blocks, learned positions, no dropout).

    ``ffn`` is the hidden width of each block's MLP (default ``4 * dim``): a wide ``ffn`` makes
    a model whose gradient is large relative to its compute (the communication-bound LM of the
    end-to-end benchmark).
    """

    def __init__(self, dim: int = 128, layers: int = 2, context: int = 64, heads: int = 4, ffn: int | None = None) -> None:
        super().__init__()
        if min(dim, layers, context, heads) < 1 or dim % heads:
            raise ValueError(f"ByteLM needs positive sizes and dim divisible by heads, got {dim=}, {heads=}")
        self.context = context
        self.embed = nn.Embedding(256, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        layer = nn.TransformerEncoderLayer(dim, nhead=heads, dim_feedforward=ffn or 4 * dim, batch_first=True,
                                           dropout=0.0)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 256)
        self.mask: torch.Tensor
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Next-byte logits for every position of ``x`` (batch, length <= context)."""
        n = x.shape[1]
        h = self.embed(x) + self.pos[:n]
        return self.head(self.blocks(h, mask=self.mask[:n, :n], is_causal=True))


def wide_byte_lm() -> ByteLM:
    """The communication-bound LM of the end-to-end benchmark: 10.8M parameters, mostly MLP.

    Two blocks of width 160 whose MLPs are 16384 wide, over 32-byte windows: with a handful
    of windows per step, its 43 MB gradient takes about 0.35 s per step on a 1 Gbit/s link
    (2 ranks, ring all-reduce) against about 0.15 s of compute on one core of this machine.
    """
    return ByteLM(dim=160, layers=2, context=32, heads=4, ffn=16384)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats)."""
    return nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))


# ----- digits ------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def digits_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits in file order: (float32 images scaled to [0, 1], int64 labels).

    Reads the CSV that scikit-learn ships instead of calling ``load_digits`` (which imports
    SciPy): about a second less start-up on every rank, same numbers.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the digits workload needs scikit-learn (pip install scikit-learn)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "datasets", "data", "digits.csv.gz")
    if os.path.exists(path):
        data = np.loadtxt(path, delimiter=",")
        images, labels = data[:, :-1], data[:, -1].astype(np.int64)
    else:  # another layout: ask scikit-learn itself
        from sklearn.datasets import load_digits

        d = load_digits()
        images, labels = d.data, d.target
    return torch.tensor(images, dtype=torch.float32) / 16.0, torch.tensor(labels, dtype=torch.int64)


@lru_cache(maxsize=1)
def digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)``: one fixed shuffle, 1437 training and 360 held-out images."""
    x, y = digits_arrays()
    perm = torch.randperm(len(y), generator=seeded(DIGITS_SPLIT_SEED))
    x, y = x[perm], y[perm]
    return x[DIGITS_TEST:], y[DIGITS_TEST:], x[:DIGITS_TEST], y[:DIGITS_TEST]


def digits_mlp(*hidden: int) -> nn.Sequential:
    """MLP ``64 -> hidden[0] -> ... -> 10`` with ReLU between layers (e.g. ``digits_mlp(256, 256)``)."""
    if not hidden or min(hidden) < 1:
        raise ValueError(f"digits_mlp needs at least one positive hidden width, got {hidden}")
    layers: list[nn.Module] = []
    width = 64
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    return nn.Sequential(*layers, nn.Linear(width, 10))
