"""Which parameters DiLoCo's outer reduction compresses (no process group needed)."""

from __future__ import annotations

import pytest
import torch

from commpress.errors import CodecError
from commpress.local.outer import DEFAULT_OUTER_MIN_NUMEL, OuterReduction

NAMES = ["emb.weight", "ln.weight", "ln.bias", "head.weight", "scale", "empty"]
SHAPES = [(64, 16), (16,), (16,), (4, 16), (1,), (0,)]


def _compressed(codec: str = "sign", **kwargs: object) -> dict[str, bool]:
    params = {"ratio": 0.1} if codec == "topk" else {}
    red = OuterReduction(NAMES, SHAPES, torch.float32, codec, params, world_size=2, rank=0, seed=0, **kwargs)  # type: ignore[arg-type]
    return dict(zip(NAMES, red.compressed))


def test_every_non_empty_parameter_goes_through_the_codec_by_default() -> None:
    # biases, norm scales and a scalar too: after H inner steps they were 11% of a 1-bit sync's bytes
    assert DEFAULT_OUTER_MIN_NUMEL == 0
    assert _compressed() == {"emb.weight": True, "ln.weight": True, "ln.bias": True, "head.weight": True,
                             "scale": True, "empty": False}
    assert _compressed("topk")["ln.bias"] and not _compressed("none")["emb.weight"]


def test_min_numel_keeps_smaller_parameters_dense_whatever_their_rank() -> None:
    assert _compressed(min_numel=64) == {"emb.weight": True, "ln.weight": False, "ln.bias": False,
                                         "head.weight": True, "scale": False, "empty": False}
    with pytest.raises(ValueError, match="min_numel"):
        _compressed(min_numel=-1)


def test_a_parameter_the_codec_cannot_take_names_itself_and_the_way_out() -> None:
    with pytest.raises(CodecError, match=r"'ln.weight' \(16,\).*min_numel=17"):
        OuterReduction(NAMES, SHAPES, torch.float32, "topk", {"k": 32}, world_size=2, rank=0, seed=0)
