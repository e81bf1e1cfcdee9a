"""Misuse never hangs: every live rank ends with a clear error within a documented bound.

The bounds (README, "Misuse does not hang"): ranks registering differently fail at registration
(or, with ``verify=False``, at the first step) on every rank at once; a rank that never
registers is named after ``verify_timeout``; a rank that dies breaks its peers' next collective
within seconds; a rank that stops answering is caught by the process group's own timeout
(``init_process_group(timeout=...)``); a rank that cannot decode what it received fails every
rank with a ``RankFailedError`` naming it, the step and the bucket, within milliseconds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import misuse_workers as mw


@pytest.mark.parametrize("option", ["codec", "ratio", "algorithm"])
def test_unverified_ranks_that_differ_fail_on_every_rank(option: str, tmp_path: Path) -> None:
    # before: codec/ratio crashed one rank with a gloo abort (SIGABRT); algorithm hung both
    reports = mw.launch("differ_unverified", 2, tmp_path, option, bound_s=60)
    for rank in (0, 1):
        error = reports[rank]["error"]
        assert error.startswith("ConfigurationError") and "configured differently" in error, reports
        assert f"ranks [{1 - rank}]" in error, reports


def test_ranks_that_never_register_are_named_on_every_rank_that_did(tmp_path: Path) -> None:
    reports = mw.launch("some_ranks_register", 3, tmp_path, [0, 1], bound_s=90)
    for rank in (0, 1):
        error = reports[rank]["error"]
        assert error.startswith("ConfigurationError") and "ranks [2] did not within 3 s" in error, reports
        assert reports[rank]["seconds"] < 3 + 10, reports
    assert reports[2]["error"], reports  # its pending collective broke when the others gave up


def test_a_killed_rank_ends_every_other_rank_with_an_error_in_seconds(tmp_path: Path) -> None:
    reports = mw.launch("killed", 3, tmp_path, [1], bound_s=90)
    assert set(reports) == {0, 2}, reports
    for rank in (0, 2):
        error = reports[rank]["error"].lower()
        assert "closed" in error or "reset" in error, reports
        assert reports[rank]["seconds"] < 30, reports


def test_a_stopped_rank_is_caught_by_the_process_group_timeout(tmp_path: Path) -> None:
    reports = mw.launch("stopped", 3, tmp_path, [1], pg_timeout_s=5, bound_s=90, stopped=(1,))
    assert set(reports) == {0, 2}, reports
    for rank in (0, 2):
        assert "timeout" in reports[rank]["error"].lower() or "timed out" in reports[rank]["error"].lower(), reports
        assert reports[rank]["seconds"] < 5 + 30, reports


@pytest.mark.parametrize(
    ("world", "codec", "opts"),
    [
        (2, "topk", {"ratio": 0.1}),  # all-gather: the bad frame is decoded in a future's callback
        (4, "sign", {"algorithm": "twophase"}),  # two-phase: phase 1 decodes on DDP's thread
    ],
)
def test_a_rank_that_cannot_decode_fails_every_rank_within_seconds(
    world: int, codec: str, opts: dict, tmp_path: Path
) -> None:
    # Rank 1 gets zeroed bytes at step 3 and stays alive 20 s after its error (a slow exit).
    # Before: only rank 1 raised; the others waited until it exited ("connection reset", 20 s)
    # or, had it stayed, for the process group's timeout (120 s here, 30 min by default).
    reports = mw.launch("corrupt", world, tmp_path, 1, codec, opts, False, pg_timeout_s=120, bound_s=100, linger={1: 20})
    assert set(reports) == set(range(world)), reports
    for rank in range(world):
        error = reports[rank]["error"]
        assert "RankFailedError: commpress: rank 1 failed at step 3, bucket " in error, reports
        assert "WireError: frame from rank 0: bad header" in error, reports
        assert abs(reports[rank]["at"] - reports[1]["at"]) < 10, reports


def test_a_rank_that_catches_its_decode_error_cannot_train_on_alone(tmp_path: Path) -> None:
    # Before: rank 1 caught the error and both ranks finished all 10 steps, their models apart.
    reports = mw.launch("corrupt", 2, tmp_path, 1, "topk", {"ratio": 0.1}, True, pg_timeout_s=120, bound_s=100)
    assert set(reports) == {0, 1}, reports
    caught = reports[1]["log"]
    assert len(caught) == 1 and "RankFailedError: commpress: rank 1 failed at step 3, bucket " in caught[0], reports
    assert reports[1]["error"], reports  # its next step fails too (DDP's own check, or commpress's)
    assert "RankFailedError: commpress: rank 1 failed at step 3, bucket " in reports[0]["error"], reports
    assert abs(reports[0]["at"] - reports[1]["at"]) < 10, reports
