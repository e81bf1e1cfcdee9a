"""Fuzzing as a tool (issue #12): short CI runs of every target, and the findings' regressions.

The targets are ``scripts/fuzz_wire.py``, ``scripts/fuzz_ps.py`` and ``scripts/fuzz_checkpoint.py``
(shared harness: ``scripts/fuzz_common.py``; seed corpora under ``tests/fuzz_corpus/<target>``).
Each runs here for a fixed ~8-10 s budget; the long runs are ``--runs 1000000``. The tests below
the short runs pin what the long runs found.
"""

import io
import os
import subprocess
import sys

import pytest
import torch

from commpress import codecs
from commpress.errors import CodecError
from commpress.feedback import ErrorFeedback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _short_run(name, seconds):
    pytest.importorskip("atheris")
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", f"fuzz_{name}.py"), "--seconds", str(seconds), "--timeout", "10"],
        env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=300,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "Done " in log and "ERROR" not in log, log[-3000:]
    runs = int(log.split("stat::number_of_executed_units:")[1].split()[0])
    rss = int(log.split("stat::peak_rss_mb:")[1].split()[0])
    assert rss < 1024, log[-2000:]
    return runs


# ----- short coverage-guided runs ------------------------------------------------------------
def test_fuzz_wire_short_run():
    """``scripts/fuzz_wire.py`` for ~10 s: only WireError, every validated decode finite, RSS < 1 GB."""
    assert _short_run("wire", 10) > 1000


def test_fuzz_ps_short_run():
    """``scripts/fuzz_ps.py`` for ~8 s: the server and worker receive paths raise only ProtocolError."""
    assert _short_run("ps", 8) > 500


def test_fuzz_checkpoint_short_run():
    """``scripts/fuzz_checkpoint.py`` for ~8 s: the loaders raise only ValueError and load nothing implausible."""
    assert _short_run("checkpoint", 8) > 300


# ----- findings of the long runs -------------------------------------------------------------
def _ef_state():
    ef = ErrorFeedback(codecs.get("topk", ratio=0.3))
    ef.compress("w", torch.randn(8), seed=1)
    return ef, ef.state_dict()


@pytest.mark.parametrize("steps, counts", [
    (-(1 << 70), {}), (-1, {}), (1 << 62, {}), (float("inf"), {}), (float("nan"), {}), (True, {}), (None, {}),
    ("3", {}), (0, [1, 2]), (0, None), (0, {"w": -1}), (0, {"w": 1.5}), (0, {3: 1}),
])
def test_error_feedback_skip_counters_are_validated(steps, counts):
    """fuzz_checkpoint: ``nonfinite_steps = -2**70`` loaded (int() of anything); now a ValueError."""
    ef, good = _ef_state()
    with pytest.raises(ValueError, match="nonfinite_steps"):
        ef.load_state_dict({**good, "nonfinite_steps": steps, "nonfinite_counts": counts})
    ef.load_state_dict({**good, "nonfinite_steps": 2, "nonfinite_counts": {"w": 2}})
    assert ef.nonfinite_steps == 2 and ef.nonfinite_counts == {"w": 2}


@pytest.mark.parametrize("config", [{"name": ["topk"]}, {"name": {"a": 1}}, {"name": "topk", "ratio": [0.3]}])
def test_malformed_codec_config_in_a_state_is_a_codec_error(config):
    """fuzz_checkpoint: a codec name of another type raised TypeError (unhashable) from the registry."""
    ef, good = _ef_state()
    with pytest.raises(CodecError, match="codec|ratio"):
        ef.load_state_dict({**good, "codec": config})


@pytest.mark.parametrize("key, value", [
    ("shapes", {"0.weight": [float("inf"), 3]}), ("shapes", [1, 2]), ("shapes", None), ("momentum", None),
    ("momentum", [0.9]), ("velocity", 3), ("momentum_rules", 7), ("stats", [1]),
])
def test_ddp_state_entries_of_the_wrong_type_are_value_errors(group_of_one, key, value):
    """fuzz_checkpoint: OverflowError/TypeError from int()/dict()/float() of hostile entries; now ValueError."""
    import commpress

    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 4))
    state = commpress.ddp.CompressionState(model, "topk", ratio=0.25, momentum=0.9, min_numel=16)
    good = state.state_dict()
    with pytest.raises(ValueError):
        state.load_state_dict({**good, key: value})
    state.load_state_dict(good)


def test_ps_checkpoint_entries_must_have_the_callers_structure(tmp_path):
    """fuzz_checkpoint: ``skipped_steps = None`` (TypeError in int()) and a clock of another length
    passed ``load(like=...)``; now every entry of ``like`` fixes the type and length."""
    from commpress.ps import ConfigError
    from commpress.ps import checkpoint as ckpt

    like = {"x": torch.zeros(3), "clock": [3, 4], "skipped_steps": 0, "optimizer": {"param_groups": [{"lr": 0.1}]}}
    for bad, match in (
        ({"skipped_steps": None}, "skipped_steps is a NoneType, expected a int"),
        ({"clock": [3, 4, 5]}, "clock is list"),
        ({"clock": 3}, "clock is int"),
        ({"optimizer": {"param_groups": [{"lr": "0.1"}]}}, r"param_groups\[0\].lr is a str"),
        ({"optimizer": {"param_groups": [{}]}}, r"param_groups\[0\].lr is missing"),
        ({"optimizer": []}, "optimizer is a list, expected a mapping"),
    ):
        ckpt.save(str(tmp_path), 0, 1, {**like, **bad})
        with pytest.raises(ConfigError, match=match):
            ckpt.load(str(tmp_path), 0, 1, like=like)
    ckpt.save(str(tmp_path), 0, 1, {**like, "extra": 1})  # entries the caller does not have are its business
    assert ckpt.load(str(tmp_path), 0, 1, like=like)["clock"] == [3, 4]


def test_ddp_state_loads_from_its_own_bytes(group_of_one):
    """The path mode 5 of fuzz_checkpoint starts from: ``load_state_dict(torch.load(bytes))``."""
    import commpress

    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 4))
    state = commpress.ddp.CompressionState(model, "sign", min_numel=16)
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    state.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
