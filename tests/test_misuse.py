"""Misuse never hangs: every live rank ends with a clear error within a documented bound.

The bounds (README, "Misuse does not hang"): ranks registering differently fail at registration
(or, with ``verify=False``, at the first step) on every rank at once; a rank that never
registers is named after ``verify_timeout``; a rank that dies breaks its peers' next collective
within seconds; a rank that stops answering is caught by the process group's own timeout
(``init_process_group(timeout=...)``).
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
