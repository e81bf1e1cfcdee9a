"""Elastic restarts (issue #28 item 2): a ``kill -9`` under ``torchrun --max-restarts``, and a world-size change.

The first test runs the torchrun recipe of ``tests/elastic_workers.py`` twice under the venv's
``torchrun`` (gloo, CPU, 2 ranks): uninterrupted, then with rank 1 SIGKILLed before step
``KILL_AT`` in the first attempt. torchrun restarts both ranks, they resume from the last
complete checkpoint (step ``KILL_AT // EVERY * EVERY``: the restart replays ``KILL_AT % EVERY``
steps) and the final parameters must equal the uninterrupted run's bit for bit. The recipe is the
example's (top-k 1%, the optimizer discovered at its first step) with a divergence guard that
fires twice, so that the guard's state crosses the restart as well.

The second saves at 2 spawned ranks and loads at 1 and at 3: the load keeps configuration, step,
counters, guard state and momentum rules, drops the per-rank residuals and velocities with one
warning that says so, and training goes on with every rank identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import elastic_workers as ew  # noqa: E402

from ddp_workers import launch  # noqa: E402

WORKERS = Path(ew.__file__).resolve()
ROOT = WORKERS.parent.parent
TORCHRUN = Path(sys.executable).with_name("torchrun")
STEPS, EVERY, KILL_AT = 24, 8, 13  # checkpoints after 8 and 16; killed before step 13: 5 steps replayed


def _torchrun(ckpt: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node=2", "--max-restarts=2", str(WORKERS),
           "--ckpt", str(ckpt), "--steps", str(STEPS), "--every", str(EVERY), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)


def _attempts(ckpt: Path, rank: int) -> list[dict[str, int]]:
    return [json.loads(line) for line in (ckpt / f"attempts-rank{rank}.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)
@pytest.mark.skipif(not TORCHRUN.exists(), reason=f"no torchrun next to {sys.executable}")
def test_torchrun_restart_after_kill9_resumes_bit_exact(tmp_path: Path) -> None:
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    ref.mkdir()
    killed.mkdir()
    guard = ("--guard-threshold", "4")  # it fires twice in 24 steps: its state crosses the restart too
    done = _torchrun(ref, *guard)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = _torchrun(killed, *guard, "--kill-rank", "1", "--kill-at", str(KILL_AT))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "exitcode: -9" in run.stderr, "rank 1 was not SIGKILLed"
    last_ckpt = KILL_AT // EVERY * EVERY
    for rank in range(2):
        assert _attempts(ref, rank) == [{"attempt": 0, "resumed_from": 0}]
        # one restart, from the last complete checkpoint: KILL_AT - last_ckpt steps are trained twice
        assert _attempts(killed, rank) == [{"attempt": 0, "resumed_from": 0}, {"attempt": 1, "resumed_from": last_ckpt}]
    finals = {(d.name, r): torch.load(d / f"final-rank{r}.pt", weights_only=True) for d in (ref, killed) for r in range(2)}
    assert torch.equal(finals["ref", 0], finals["ref", 1])
    for rank in range(2):
        assert torch.equal(finals["killed", rank], finals["ref", 0]), f"rank {rank}: the restarted run differs"
    stats = json.loads((killed / "stats-rank0.json").read_text())
    assert stats["steps"] == STEPS and stats["compression_ratio"] > 2, stats  # compressed between the dense windows
    assert stats["guard_fired"] >= 1 and stats["guard_dense_steps"] >= 5, stats


@pytest.mark.timeout(300)
def test_load_at_another_world_size_keeps_what_is_global_and_drops_per_rank_state(tmp_path: Path) -> None:
    launch(ew.resize_save, 2, str(tmp_path), ["auto", "twophase"])
    launch(ew.resize_load, 1, str(tmp_path), ["auto"], 2)  # two-phase needs 2 ranks or more
    launch(ew.resize_load, 3, str(tmp_path), ["auto", "twophase"], 2)
    for algorithm, world in (("auto", 1), ("auto", 3), ("twophase", 3)):
        saved = json.loads((tmp_path / algorithm / "saved.json").read_text())
        for rank in range(world):
            got = json.loads((tmp_path / algorithm / f"loaded-{world}-rank{rank}.json").read_text())
            assert "error" not in got, got["error"]
            assert len(got["warnings"]) == 1, got["warnings"]
            warning = got["warnings"][0]
            file_rank = rank if rank < 2 else 0  # a rank the old run did not have reads rank 0's file
            assert f"written by 2 ranks (file of rank {file_rank})" in warning, warning
            assert f"loaded at {world} ranks (rank {rank})" in warning and "dropped" in warning, warning
            assert "error-feedback residual" in warning and "4 velocity" in warning, warning
            assert got["step"] == ew.RESIZE_STEPS
            assert got["stats"]["steps"] == ew.RESIZE_STEPS
            assert got["stats"]["bytes_sent"] > 0  # the counters came with the file
            assert got["guard"] == saved["guard"] and got["guard"][3] > 0  # the guard's measured ratio
            assert got["rules"] == saved["rules"]
            assert got["residuals"] == 0 and got["velocities"] == 0
            assert got["after_step"] == ew.RESIZE_STEPS + 3 and got["same_across_ranks"], (algorithm, world, got)


def test_init_restartable_process_group_refuses_what_it_reads_from_torchrun() -> None:
    import commpress

    for key in ("rank", "world_size", "store", "init_method"):
        with pytest.raises(ValueError, match=f"reads {key} from torchrun's environment"):
            commpress.init_restartable_process_group("gloo", **{key: 0})
