"""Which tensors travel compressed: the one rule shared by the DDP hook and the parameter server.

Tiny tensors and 1-D tensors (biases, norm scales) cost almost nothing to send dense, while
compressing them hurts most (a top-1% of a 64-element bias is one number; one sign scale per
LayerNorm mixes unrelated channels; see the design notes' measurements). So a tensor is
compressed only when it has at least two dimensions (unless ``dense_1d`` is off) and at
least ``min_numel`` elements.

``numel`` may be smaller than the parameter's: the parameter server decides per *piece* of a
parameter (the part inside one shard), still judged by the parameter's shape, so a matrix cut
by a shard boundary keeps its pieces compressed only while each is big enough.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

#: ``compress_filter(name, parameter) -> bool``: True to compress the parameter (DDP and FSDP).
CompressFilter = Callable[[str, torch.nn.Parameter], bool]

#: DDP's default ``min_numel`` (``CompressionState``); the parameter server's ``min_compress``
#: option is the same threshold with its own default.
DEFAULT_MIN_NUMEL = 1024


@dataclass(frozen=True)
class SelectionRule:
    """Compress a tensor iff it has >= 2 dims (or ``dense_1d`` is False) and >= ``min_numel`` elements (at least one)."""

    min_numel: int = DEFAULT_MIN_NUMEL
    dense_1d: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.min_numel, int) or isinstance(self.min_numel, bool) or self.min_numel < 0:
            raise ValueError(f"min_numel must be an int >= 0, got {self.min_numel!r}")
        if not isinstance(self.dense_1d, bool):
            raise ValueError(f"dense_1d must be a bool, got {self.dense_1d!r}")

    def __call__(self, name: str, shape: Sequence[int], numel: int | None = None) -> bool:
        """Whether the tensor ``name`` of ``shape`` (``numel`` elements of it, default all) is compressed.

        ``name`` is not used by the default rule; it is part of the signature so that custom
        rules (DDP's ``compress_filter``) can select by name.
        """
        if self.dense_1d and len(shape) <= 1:
            return False
        n = math.prod(shape) if numel is None else numel
        return n > 0 and n >= self.min_numel  # an empty tensor has nothing to compress


def embedding_like(model: torch.nn.Module) -> set[int]:
    """``id`` s of ``model``'s embedding-like parameters: the tables indexed by a vocabulary.

    Those are the weights of every ``nn.Embedding`` / ``nn.EmbeddingBag``, every parameter tied to
    one (the same tensor under another module, e.g. a tied output layer), and the weight of every
    ``nn.Linear`` shaped like one of those tables (``(num_embeddings, embedding_dim)``: the output
    projection onto its vocabulary, tied or not). Their gradients' rows scale with how often each
    token occurs, so one scale per tensor (sign, QSGD's norm) or one top-k over it serves the
    frequent rows and buries the rare ones; the FSDP adapter keeps them exact
    (``exact_embeddings=``). A model whose width equals its vocabulary size also matches its square
    ``nn.Linear`` layers (then pass ``compress_filter=``).
    """
    tables = [m.weight for m in model.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))]
    out = {id(w) for w in tables}
    shapes = {tuple(w.shape) for w in tables}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and tuple(m.weight.shape) in shapes:
            out.add(id(m.weight))
    return out


def compress(name: str, shape: Sequence[int], numel: int | None = None, *,
             min_numel: int = DEFAULT_MIN_NUMEL, dense_1d: bool = True) -> bool:
    """:class:`SelectionRule` as a function: ``compress("fc.weight", (256, 784))`` -> True."""
    return SelectionRule(min_numel, dense_1d)(name, shape, numel)


__all__ = ["DEFAULT_MIN_NUMEL", "CompressFilter", "SelectionRule", "compress", "embedding_like"]
