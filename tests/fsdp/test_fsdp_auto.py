"""``codec="auto"`` on FSDP2 per module (tests/fsdp_auto_workers.py, 2 gloo ranks) and FSDP discovery's first step.

The cost model's sharded predictions are checked as pure arithmetic; the workers check that a
slow link (``auto_link=``) chooses the compressed options, a very fast one FSDP bit for bit, that
ranks agree, that the choice survives DCP and ``state_dict`` save + load, that a failed
calibration falls back to exact on every rank, and that every module forced to bf16 or to
compressed trains bit for bit as ``register(model, "bf16", param_codec="bf16")`` or the
recommended setting does.
"""

from __future__ import annotations

from pathlib import Path

import fsdp_auto_workers as aw
import pytest
from torch import nn

import commpress.fsdp
from commpress.codecs import get
from commpress.comm.costmodel import (
    SHARDED_OPTIONS,
    DeviceCost,
    Entry,
    Link,
    best,
    path_overhead,
    predict_all_gather,
    predict_reduce_scatter,
)
from commpress.errors import CodecError

import ddp_workers as w

COST = DeviceCost(encode_s=2e-9, decode_s=1e-9, pass_s=0.3e-9, cast_s=0.5e-9)
CODECS = {"bf16": get("bf16"), "compressed": get("qsgd", bits=2)}


def test_reduce_scatter_prediction_follows_the_link() -> None:
    entries = [Entry(1 << 20, True), Entry(128, False)]
    costs = dict.fromkeys(CODECS, COST)
    slow = predict_reduce_scatter(entries, 2, Link.from_gbit(1.0), costs, CODECS)
    fast = predict_reduce_scatter(entries, 2, Link.from_gbit(1e6, latency_s=0.0), costs, CODECS)
    assert best(slow, SHARDED_OPTIONS) == "compressed" and best(fast, SHARDED_OPTIONS) == "dense"
    # bytes: at 2 ranks the fp32 ring reduce-scatter sends half its input of two chunks: one chunk
    chunk = (1 << 20) + 128
    assert slow["dense"] == pytest.approx(50e-6 + 4 * chunk * Link.from_gbit(1.0).beta + COST.pass_s * chunk)
    assert slow["dense"] > slow["bf16"] > slow["compressed"]
    # a tie goes to the more exact option
    assert best({"dense": 1.0, "bf16": 1.0, "compressed": 1.0}, SHARDED_OPTIONS) == "dense"


def test_all_gather_prediction_counts_gathers_and_reuse() -> None:
    link = Link.from_gbit(1.0)
    kw = {"dense_bytes": 4000, "frames": {"compressed": (1100, COST)}}
    two = predict_all_gather(1000, 1000, 2, link, gathers=2, reuse=("compressed",), **kw)  # type: ignore[arg-type]
    again = predict_all_gather(1000, 1000, 2, link, gathers=2, **kw)  # type: ignore[arg-type]
    one = predict_all_gather(1000, 1000, 2, link, gathers=1, **kw)  # type: ignore[arg-type]
    assert two["dense"] == pytest.approx(2 * one["dense"])
    assert one["compressed"] < two["compressed"] < again["compressed"] == pytest.approx(2 * one["compressed"])
    # reuse: the backward decodes the kept frames (n decodes), no second all-gather or encode
    assert two["compressed"] - one["compressed"] == pytest.approx(2 * 1000 * COST.decode_s)


def test_path_overhead_is_what_the_model_missed_beyond_the_exact_path() -> None:
    measured = {"dense": 1.0e-3, "bf16": 1.2e-3, "compressed": 3.0e-3}
    predicted = {"dense": 0.9e-3, "bf16": 1.0e-3, "compressed": 0.5e-3}
    got = path_overhead(measured, predicted)
    assert got["dense"] == 0.0
    assert got["bf16"] == pytest.approx(0.1e-3) and got["compressed"] == pytest.approx(2.4e-3)
    assert path_overhead({"dense": 1.0, "bf16": 0.5}, {"dense": 1.0, "bf16": 1.0})["bf16"] == 0.0  # never negative


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"auto_link": "fast"}, "auto_link must be a commpress.comm.costmodel.Link"),
        ({"auto_link": 1e9}, "auto_link must be"),
        ({"bits": 4}, "takes no codec parameters"),
        ({"param_codec": "int8"}, "takes no param_codec="),
        ({"error_feedback": True}, "takes no error_feedback=True"),
        ({"warmup_codec": "qsgd"}, "takes no warmup_codec="),
        ({"warmup_steps": 5}, "takes no warmup_steps=5"),
        ({"auto_calibration_numel": 0}, "auto_calibration_numel must be an int"),
    ],
)
def test_bad_auto_options_are_named(options: dict, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        commpress.fsdp.register(nn.Linear(2, 2), "auto", **options)


def test_auto_options_belong_to_auto() -> None:
    with pytest.raises(CodecError, match="auto_link are options of codec='auto', not of 'qsgd'"):
        commpress.fsdp.register(nn.Linear(2, 2), "qsgd", auto_link=Link.from_gbit(1.0))
    with pytest.raises(CodecError, match="link bandwidth must be > 0"):
        Link.from_gbit(0)


def test_auto_chooses_per_module_and_survives_checkpoints(tmp_path: Path) -> None:
    w.launch(aw.worker_auto, 2, str(tmp_path), timeout=240)
    assert all((tmp_path / f"done{r}").exists() for r in range(2))


def test_discovered_optimizer_is_bit_for_bit_the_passed_one() -> None:
    w.launch(aw.worker_discovery_first_step, 2, timeout=240)

