"""Compressed parameter all-gather of FSDP2 (``param_codec=``): gloo tests on CPU.

One launch of 2 ranks runs every scenario (tests/fsdp_allgather_workers.py): ``None`` leaves
FSDP's all-gather in place and ``"none"`` is it bit for bit; int8/int4 track FSDP's losses
within ``LOSS_TOL`` over 6 SGD steps, ranks stay bit-identical, the gathered weights are the
codec's decode of each shard and within the stated bound, the master shards stay exact fp32;
bf16 ``MixedPrecisionPolicy`` composes; forward/backward codecs are chosen apart; mixed
parameter dtypes and ranks set up differently are refused clearly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import commpress.fsdp
from commpress.errors import CodecError
from commpress.fsdp.allgather import resolve_param_codec

import ddp_workers as w
import fsdp_allgather_workers as aw
import misuse_workers as mw


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("nope", "unknown codec 'nope'"),
        ("topk:ratio=0.1", "subset of the elements"),
        ("qsgd:coding=gamma", "data-dependent size"),
        ("int8:block_size=0", "block_size"),
        (3, "must be None, a codec name"),
        ({"forward": "int8"}, "exactly the keys 'forward' and 'backward'"),
        ({"forward": "int8", "backward": 1.5}, r"param_codec\['backward'\] must be None"),
        ({"forward": "none", "backward": "reuse"}, "reshard_after_forward=False"),
        ("reuse", "for the backward only"),
    ],
)
def test_bad_param_codec_raises_clear_errors(value: object, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        commpress.fsdp.register(torch.nn.Linear(64, 64), "none", param_codec=value)


def test_param_codec_forms() -> None:
    assert resolve_param_codec(None) is None
    both = resolve_param_codec("int4:block_size=128")
    assert both is not None and not both[1]
    assert both[0]["forward"] == both[0]["backward"] == commpress.codecs.get("int4", block_size=128)
    split = resolve_param_codec({"forward": commpress.codecs.get("int8"), "backward": None})
    assert split is not None and split[0]["backward"].name == "none" and split[0]["forward"].name == "int8"
    reuse = resolve_param_codec({"forward": "int8", "backward": "reuse"})
    assert reuse is not None and reuse[1] and reuse[0]["backward"] == reuse[0]["forward"] == commpress.codecs.get("int8")


def test_compressed_allgather_on_two_ranks(tmp_path: Path) -> None:
    w.launch(aw.worker_all, 2, str(tmp_path), timeout=120)
    report = json.loads((tmp_path / "allgather.json").read_text())
    print(json.dumps(report, indent=1))
    assert report["int8"]["allgather_compression_ratio"] > 3.0
    assert report["int4"]["allgather_compression_ratio"] > report["int8"]["allgather_compression_ratio"]


def test_error_feedback_computes_in_float32_when_a_bf16_policy_reduces_in_bf16() -> None:
    w.launch(aw.worker_low_precision_reduce_computes_feedback_in_float32, 2, timeout=120)


def test_a_nan_shard_fails_every_rank_within_seconds(tmp_path: Path) -> None:
    """NaN in one rank's parameter shard: its encode raises (NonFiniteError), the fault channel
    makes it every rank's RankFailedError instead of leaving the others in the all-gather."""
    reports = mw.launch(aw.case_nan_shard, 2, tmp_path, 1, pg_timeout_s=120, bound_s=60)
    assert set(reports) == {0, 1}, reports
    for rank in (0, 1):
        error = reports[rank]["error"]
        assert "RankFailedError: commpress: rank 1 failed at module 'h1', forward all-gather 2" in error, reports
        assert "NonFiniteError: parameter 'h1.weight': this rank's shard contains NaN or Inf" in error, reports
        assert abs(reports[rank]["at"] - reports[1]["at"]) < 10, reports
