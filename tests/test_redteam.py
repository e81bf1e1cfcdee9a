"""``scripts/redteam.py`` (issue #12's red-team table) runs and prints a well-formed table.

What each case finds is asserted by the regression tests (tests/test_hostile.py and others);
this only keeps the script itself from rotting: two fast rows through ``--only``, the table's
shape, and the options.
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "redteam.py")
ENV = {**os.environ, "PYTHONPATH": ROOT}
HEADER = "| # | case | what the issue saw | outcome now | time | peak RSS delta |"


def _run(*args, timeout=240):
    return subprocess.run([sys.executable, SCRIPT, *args], env=ENV, capture_output=True, text=True, timeout=timeout)


def _cells(line):
    return [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]


def test_two_fast_rows_print_a_markdown_table():
    out = _run("--only", "3b", "--only", "7b")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("Red-team pass of issue #12, re-measured: commit ")
    assert "Command: `python scripts/redteam.py --only 3b --only 7b`" in lines[0]
    i = lines.index(HEADER)
    assert lines[i + 1] == "|---|---|---|---|---|---|"
    rows = [_cells(ln) for ln in lines[i + 2 :] if ln.startswith("| ")]
    assert [r[0] for r in rows] == ["3b", "7b"] and all(len(r) == 6 for r in rows), rows
    for row_id, case, saw, outcome, took, rss in rows:
        assert case and saw and outcome, row_id
        assert not outcome.startswith(("HANG", "CRASH", "harness")), (row_id, outcome)
        assert re.search(r"\d+(\.\d+)? m?s", took), (row_id, took)
    assert re.fullmatch(r"-?\d+ MB", rows[0][5]), rows[0]  # a memory-bomb row reports its RSS growth
    assert rows[1][5] == ""
    assert lines[-1].startswith("2 rows in ")


def test_options():
    listed = _run("--list", timeout=60)
    assert listed.returncode == 0
    ids = [ln.split()[0] for ln in listed.stdout.splitlines()]
    assert ids[:3] == ["1a", "1b", "1c"] and "8" in ids and ids[-2:] == ["H1", "H2"]
    bad = _run("--only", "99", timeout=60)
    assert bad.returncode == 2 and "no such case" in bad.stderr
