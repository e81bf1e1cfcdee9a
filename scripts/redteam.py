#!/usr/bin/env python
"""Re-run the red-team pass of issue #12 against the current code and print a markdown table.

Every case of the issue's "Why" (failures 1-8 and the cheap "held" items) is reproduced as the
issue describes it, through the public APIs, ``mpirun ... python -m commpress.ps`` or a rank
script run under ``mpirun`` (``--rank``), and a 2-rank gloo DDP job for case 8. Each row runs
in its own subprocess with a timeout, so a segfault or a hang is reported as such (``CRASH``,
``HANG``) instead of ending this script. Columns: what the issue saw on the old main; the
outcome now (exception type and the first words of its message, exit code, or result); the
time (the measured operation where the case has one, else the subprocess's wall time); the
peak RSS growth where memory is the question (``ru_maxrss`` after minus before, in a fresh
process, so it is the operation's high-water mark).

    python scripts/redteam.py              # every case (about 5 min on 2 busy cores)
    python scripts/redteam.py --only 3     # case 3's rows; also a row id (6b) or "held"
    python scripts/redteam.py --list       # the row ids

The harness is in ``redteam_harness.py``, the cases in ``redteam_cases.py``, the rank programs
(run as ``redteam.py --rank NAME`` under mpirun) in ``redteam_ranks.py``; this file holds the
table of rows and the command line.

Needs the dev requirements (pytest: the regression tests' helpers are imported from tests/)
and ``mpirun`` in the venv for the parameter-server rows (without it they say so).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redteam_cases as c
from redteam_harness import DDP_CAP_S, RESULT, ROOT, run_cmd, words
from redteam_ranks import rank_main


# ----- the table -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One row of the table: what is tried, what the issue saw, the child that tries it."""

    id: str
    case: str
    saw: str
    fn: Callable[[], dict[str, Any]]
    timeout: float
    rss: bool = False


ROWS: list[Row] = [
    Row("1a", "`sign` block_size near 2**63, codec API (encode+decode 1000 floats)",
        "segfault in `_C` (block count overflow, `scales[0]` of an empty tensor)", c.case_1a, 60),
    Row("1b", "`--codec sign:block_size=9223372036854775807` on the PS (mpirun -n 3)", "segfault", c.case_1b, 170),
    Row("1c", "wire packet with p0 >= 2**63, `wire.from_bytes` + decode", "torch type error instead of `WireError`",
        c.case_1c, 60),
    Row("2a", "sync PS run, worker 0's loss NaN at step 3 (topk:ratio=0.1, mpirun -n 3)",
        "skip push carried the NaN loss, rejected; server: worker 'sent nothing', exit 3", c.case_2a, 170),
    Row("2b", "`--batch-size -5` on the PS (mpirun -n 3)", "same path: 'sent nothing', exit 3", c.case_2b, 170),
    Row("3a", "qsgd:coding=gamma PUSH claiming numel=2**40, to a server", "`MemoryError` in `from_bytes`, server exits",
        c.case_3a, 90, rss=True),
    Row("3b", "72-byte top-k packet, `wire.from_bytes` + decode", "allocated 1.31 GB", c.case_3b, 90, rss=True),
    Row("3c", "56-byte random-k packet, `wire.from_bytes` + decode", "allocated 5.7 GB, 8.4 s", c.case_3c, 90, rss=True),
    Row("4", "25,000 mutated packets, every codec x dtype, `from_bytes` + decode",
        "178 decodes not finite; 49 exceptions other than `WireError`", c.case_4, 200, rss=True),
    Row("5a", "async PS: worker 1's first PULL has a wrong fingerprint (then it joins)",
        "uncaught `ConfigError`, exit 2", c.case_5a, 170),
    Row("5b", "sync PS: worker 1 sends a BYE at step 0 (then trains on)", "exit 1", c.case_5b, 170),
    Row("6a", "PUSH whose sender cleared the CRC flag, to a server", "accepted (trusted)", c.case_6a, 60),
    Row("6b", "worker 0's step-5 push: one value's exponent bit flipped, CRC recomputed (none, 40 steps)",
        "accuracy 85.8% -> 20.6%, no magnitude check", c.case_6b, 220),
    Row("6c", "PS checkpoint with one byte flipped in a stored float", "loaded a shard value of 3.5e37 silently",
        c.case_6c, 60),
    Row("6d", "PS worker checkpoint (valid digest) with residuals of 1e30", "accepted", c.case_6d, 60),
    Row("6e", "DDP `CompressionState.load_state_dict`: residual 1e30, step 2**70, codec 'topk' / 7",
        "1e30 and 2**70 accepted; codec: cryptic `ValueError`/`TypeError`", c.case_6e, 90),
    Row("7a", "symlinks planted at the old temp names (`.tmp<pid>`), then a PS checkpoint save",
        "write redirected through the symlink", c.case_7a, 60),
    Row("7b", "PS checkpoint file modes (umask 022)", "world-readable", c.case_7b, 60),
    Row("8", "DDP, 2 gloo ranks, top-k: rank 1 receives a zeroed frame at step 3 and stays alive",
        "only rank 1 raises; the others wait for the gloo timeout", c.case_8, DDP_CAP_S + 150),
    Row("H1", "PS, 2 servers: 7 message faults x 2 workers x 30 steps (mpirun -n 4)",
        "held: 20,036 invalid messages, training bit-identical, bounded memory", c.case_h1, 260, rss=True),
    Row("H2", "PS: kill -9 of worker 0 at step 5 (mpirun -n 3)", "held: the job ends in 0.3 s", c.case_h2, 170),
]
BY_ID = {r.id.lower(): r for r in ROWS}


def run_row(row: Row) -> dict[str, Any]:
    """Run ``row`` in a child process with its timeout; what it reported, or how it died."""
    rc, out, err, wall = run_cmd([sys.executable, __file__, "--child", row.id], row.timeout)
    res: dict[str, Any] = {"wall": wall}
    lines = [ln for ln in out.splitlines() if ln.startswith(RESULT)]
    if rc is None:
        res["outcome"] = f"HANG: no result within {row.timeout:.0f} s (killed)"
    elif lines:
        res.update(json.loads(lines[-1][len(RESULT):]))
    elif rc < 0:
        res["outcome"] = f"CRASH: the process died on {signal.Signals(-rc).name}"
    else:
        tail = [ln for ln in err.splitlines() if ln.strip()]
        res["outcome"] = f"harness error (exit {rc}): {words(tail[-1] if tail else 'no output', 150)}"
    return res


def cell(text: str) -> str:
    """A markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def fmt_time(res: dict[str, Any]) -> str:
    """The operation's time where the case measured one, and the row's wall time."""
    if res.get("time_text"):
        return f"{res['time_text']} (wall {res['wall']:.1f} s)"
    if res.get("seconds") is not None:
        s = float(res["seconds"])
        op = f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"
        return f"{op} (wall {res['wall']:.1f} s)"
    return f"{res['wall']:.1f} s"


def header() -> str:
    """Where and when the table was measured."""
    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "?", ""
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    return (f"Red-team pass of issue #12, re-measured: commit {commit or '?'}{' (modified)' if dirty else ''}, "
            f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, load average {load}. "
            f"Command: `python scripts/redteam.py{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}`.")


def main(argv: list[str] | None = None) -> int:
    """Run the selected rows (or one child / one rank script) and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", action="append", default=[],
                   help="a case number (1-8), a row id (e.g. 6b) or 'held'; repeatable")
    p.add_argument("--list", action="store_true", help="list the rows and exit")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--rank", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank:
        return rank_main(args.rank)
    if args.child:
        res = BY_ID[args.child.lower()].fn()
        print(RESULT + json.dumps(res), flush=True)
        return 0
    if args.list:
        for r in ROWS:
            print(f"{r.id:4} {r.case}")
        return 0
    rows = ROWS
    if args.only:
        want = [w.lower() for w in args.only]
        rows = [r for r in ROWS if r.id.lower() in want or r.id.lower().rstrip("abcdefg") in want
                or ("held" in want and r.id.startswith("H"))]
        if not rows:
            p.error(f"--only {' '.join(args.only)}: no such case (see --list)")
    print(header())
    print()
    print("| # | case | what the issue saw | outcome now | time | peak RSS delta |")
    print("|---|---|---|---|---|---|")
    t0 = time.monotonic()
    for row in rows:
        res = run_row(row)
        rss = f"{res['rss_mb']:.0f} MB" if row.rss and res.get("rss_mb") is not None else ("n/a" if row.rss else "")
        print(f"| {row.id} | {cell(row.case)} | {cell(row.saw)} | {cell(res['outcome'])} | {fmt_time(res)} | {rss} |",
              flush=True)
    print()
    print(f"{len(rows)} rows in {time.monotonic() - t0:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
