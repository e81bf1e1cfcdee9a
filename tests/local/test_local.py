"""commpress.local: LocalSGD and DiLoCo (2 gloo ranks each, workers in tests/local_workers.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import commpress.local
from commpress.errors import ConfigurationError

import ddp_workers as w
import local_workers as lw


def test_h1_identity_codec_equals_data_parallel_sgd() -> None:
    w.launch(lw.worker_equals_data_parallel, 2, timeout=120)


def test_localsgd_averages_exactly_every_h_steps() -> None:
    w.launch(lw.worker_localsgd_every_h, 2, 3, timeout=120)


#: biased with residuals (top-k, error feedback) and unbiased with shared seeds (QSGD), both with outer momentum
RESUME_CASES: list[tuple[str, dict[str, Any]]] = [("topk", {"ratio": 0.1}), ("qsgd", {"bits": 8})]


def test_resume_in_fresh_processes_is_bit_exact(tmp_path: Path) -> None:
    # 9 steps, H=3: saved after 4 (mid-interval, after one sync with residuals and outer momentum)
    w.launch(lw.worker_resume_save, 2, str(tmp_path), RESUME_CASES, 4, 9, timeout=120)
    w.launch(lw.worker_resume_load, 2, str(tmp_path), RESUME_CASES, 4, 9, timeout=120)
    for codec, _ in RESUME_CASES:
        out = tmp_path / codec
        for rank in range(2):
            assert (out / f"resumed{rank}").read_text() == (out / f"full{rank}").read_text(), codec
        assert (out / "full0").read_text() == (out / "full1").read_text(), codec  # it ends on a sync


def test_nonfinite_pseudo_gradient_on_one_rank_skips_the_outer_step_everywhere() -> None:
    # dense all-reduce (NaN propagates), all-gather with error feedback (sign), unbiased QSGD
    w.launch(lw.worker_nonfinite_skips, 2, [("none", {}), ("sign", {}), ("qsgd", {"bits": 8})], timeout=120)


def test_ranks_configured_differently_fail_at_construction() -> None:
    w.launch(lw.worker_ranks_disagree, 2, timeout=120)


def test_bad_arguments_raise_clear_errors() -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for trainer in (commpress.local.LocalSGD, commpress.local.DiLoCo):
        with pytest.raises(ConfigurationError, match="sync_every must be an int >= 1"):
            trainer(model, opt, sync_every=0)
        with pytest.raises(ConfigurationError, match="sync_every must be an int >= 1"):
            trainer(model, opt, sync_every=2.5)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="model must be a torch.nn.Module"):
            trainer(lambda x: x, opt)
        with pytest.raises(ConfigurationError, match="optimizer must be a torch.optim.Optimizer"):
            trainer(model, "sgd")
        with pytest.raises(ConfigurationError, match="does not update parameter"):
            trainer(model, torch.optim.SGD([model.weight], lr=0.1))
        with pytest.raises(RuntimeError, match="init_process_group"):
            trainer(model, opt)


@pytest.mark.parametrize(("case", "overlap"), [("exit", 0), ("exit0", 1), ("hang", 0)])
def test_a_rank_lost_between_syncs_ends_the_live_rank_with_a_clear_error(tmp_path: Path, case: str, overlap: int) -> None:
    # rank 1 exits (its connections close), rank 0 (the store's host) exits, or rank 1 hangs past sync_timeout=3 s
    out = tmp_path / "seen.json"
    w.launch(lw.worker_peer_lost, 2, str(out), case, overlap, timeout=60)
    seen = json.loads(out.read_text())
    lost = 0 if case == "exit0" else 1
    assert seen["rank"] == lost, seen
    assert f"rank {lost} failed at commpress.local.DiLoCo sync" in seen["message"], seen
    assert ("did not arrive" in seen["message"]) if case != "exit0" else ("rank 0, is gone" in seen["message"]), seen
    assert seen["elapsed"] < seen["timeout"] + 5, seen  # bounded (a hang would be gloo's 90 s here)
    assert seen["again"] == seen["message"], seen  # the trainer stays failed
