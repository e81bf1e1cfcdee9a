"""FSDP keeps embedding-like parameters exact (tests/fsdp_quality_workers.py; gloo on CPU).

The rule (:func:`commpress.selection.embedding_like`) and its effect on the reduce-scatter and the
parameter all-gather; the held-out loss it buys is measured in docs/fsdp.md (too slow for a test).
"""

from __future__ import annotations

import fsdp_quality_workers as qw
import pytest
import torch
from torch import nn

import commpress.fsdp
from commpress.errors import CodecError
from commpress.selection import embedding_like

import ddp_workers as w


def test_embedding_like_finds_tables_tied_weights_and_vocabulary_projections() -> None:
    model = qw.TinyLM(tied=False)
    found = embedding_like(model)
    assert found == {id(model.embed.weight), id(model.head.weight)}
    tied = qw.TinyLM(tied=True)
    assert embedding_like(tied) == {id(tied.embed.weight)}  # the head *is* the table
    bag = nn.Sequential(nn.EmbeddingBag(100, 8), nn.Linear(8, 100), nn.Linear(8, 8), nn.Linear(100, 8))
    assert embedding_like(bag) == {id(bag[0].weight), id(bag[1].weight)}  # (100, 8) only, not its transpose
    assert embedding_like(nn.Sequential(nn.Linear(8, 8), nn.Conv1d(8, 8, 3))) == set()


def test_exact_embeddings_must_be_a_bool() -> None:
    with pytest.raises(CodecError, match="exact_embeddings must be a bool"):
        commpress.fsdp.register(torch.nn.Linear(64, 64), "sign", exact_embeddings="yes")  # type: ignore[arg-type]


def test_embeddings_and_vocabulary_projection_reduce_exactly_blocks_compressed() -> None:
    """Untied and tied; sign, 2-bit QSGD, top-k; fails if the rule is off (``exact_embeddings=False`` checked too)."""
    w.launch(qw.worker_exact_embeddings, 2, timeout=240)
