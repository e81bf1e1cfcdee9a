"""The red-team harness (scripts/redteam.py): paths, child processes, mpirun, result lines.

What every case and rank program of the red-team pass shares: the environment its children run
in (``tests/`` and the checkout on ``sys.path``, mpirun's root flags), running a command in its
own session with a hard timeout, the result and report lines children print, measuring one
operation (time, peak RSS growth), and the one-line summaries of parameter-server and
rank-program jobs. Imported by ``redteam_cases.py`` and ``redteam_ranks.py``; knows no case.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
for _p in (TESTS, ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)
#: The entry point: the rank programs run as ``python scripts/redteam.py --rank NAME``.
ENTRY = os.path.join(ROOT, "scripts", "redteam.py")
MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")
ENV = {
    **os.environ, "PYTHONPATH": os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]),
    "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}
RESULT = "REDTEAM-RESULT "  # a child's last stdout line: its result as JSON
RANK_OUT = "REDTEAM-RANK "  # a rank script's report line (rank 0, and every rank's RSS)
AS_LIMIT = 8 << 30  # address-space cap of the memory-bomb children: a regression fails, never swaps
PS_STEPS = 20
DDP_CAP_S = 60.0  # case 8: how long after the corruption the other ranks get to report an error
DDP_PG_TIMEOUT_S = 120.0


# ----- small helpers -------------------------------------------------------------------------
def words(text: str, n: int = 110) -> str:
    """``text`` on one line, cut to about ``n`` characters."""
    one = " ".join(str(text).split())
    return one if len(one) <= n else one[: n - 1].rstrip() + "…"


def describe(exc: BaseException, n: int = 110) -> str:
    """Exception type and the first words of its message."""
    return words(f"{type(exc).__name__}: {exc}", n)


def maxrss_mb() -> float:
    """This process's peak resident set size so far, in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def cap_address_space() -> None:
    """Cap this child's address space (a regression then raises MemoryError instead of swapping)."""
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def scratch(prefix: str) -> str:
    """A temporary directory removed when this (child) process exits."""
    d = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, d, True)
    return d


def measured(fn: Callable[[], str]) -> dict[str, Any]:
    """Run ``fn`` once: its result (or the exception it raised), seconds and peak RSS growth."""
    r0, t0 = maxrss_mb(), time.perf_counter()
    try:
        outcome = fn()
    except Exception as exc:  # noqa: BLE001 - the outcome is whatever it raised
        outcome = describe(exc)
    return {"outcome": outcome, "seconds": time.perf_counter() - t0, "rss_mb": maxrss_mb() - r0}


def attempt(fn: Callable[[], str]) -> str:
    """``fn()``'s result, or the exception it raised."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        return describe(exc, 90)


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_cmd(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int | None, str, str, float]:
    """Run ``cmd`` in its own session; (returncode or None on timeout, stdout, stderr, seconds)."""
    t0 = time.monotonic()
    with subprocess.Popen(cmd, env=env or ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as p:
        try:
            out, err = p.communicate(timeout=timeout)
            rc: int | None = p.returncode
        except subprocess.TimeoutExpired:
            _kill_group(p)
            out, err = p.communicate()
            rc = None
    return rc, out, err, time.monotonic() - t0


def mpirun(n: int, args: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int | None, str, str, float]:
    """``mpirun -n n --oversubscribe python ARGS`` with a hard timeout (every rank killed on expiry)."""
    if not os.path.exists(MPIRUN):
        raise RuntimeError(f"no mpirun next to {sys.executable}: parameter-server rows need it")
    return run_cmd([MPIRUN, "-n", str(n), "--oversubscribe", sys.executable, *args], timeout, env)


def rank_job(n: int, name: str, timeout: float, env: dict[str, str] | None = None) -> tuple[int | None, str, str, float]:
    """``mpirun -n n python scripts/redteam.py --rank NAME``: one rank program (redteam_ranks.py)."""
    return mpirun(n, [ENTRY, "--rank", name], timeout, env)


def rank_reports(out: str) -> list[dict[str, Any]]:
    """The report lines a rank script printed."""
    return [json.loads(line[len(RANK_OUT):]) for line in out.splitlines() if line.startswith(RANK_OUT)]


def ps_error(err: str) -> str:
    """The line of a parameter-server job's stderr that says why it stopped (or '')."""
    found = re.findall(r"\[commpress\.ps rank \d+\] error: .*", err)
    if found:
        return words(found[0], 150)
    sig = re.search(r"exited on signal (\d+) \(([^)]+)\)", err)
    if sig:
        return f"CRASH: a rank died on signal {sig.group(1)} ({sig.group(2)})"
    tail = [ln for ln in err.splitlines() if re.match(r"^\w*(Error|Exception)\b", ln)]
    return words(tail[-1], 150) if tail else ""


def rejections(err: str) -> list[str]:
    """The servers' 'rejected a message' / implausible-push lines, shortened."""
    lines = re.findall(r"rejected a message from rank \d+: .*|rank \d+\b.*\bimplausible.*|PUSH at step \d+: norm .*", err)
    return [words(ln, 120) for ln in lines]


def ps_summary(rc: int | None, secs: float, out: str, err: str, timeout: float) -> str:
    """One line for a ``python -m commpress.ps --json`` job."""
    if rc is None:
        return f"HANG: no exit within {timeout:.0f} s"
    head = f"exit {rc}"
    if rc == 0:
        try:
            rep = json.loads(out.strip().splitlines()[-1])
            acc = rep["metrics"].get("test_accuracy")
            head += (f", {rep['steps']} steps, accuracy {acc:.1f}%, rejected {rep['rejected']}, "
                     f"skipped pushes {rep['skipped_pushes']}")
        except (ValueError, KeyError, IndexError):
            head += ", no summary"
    why = ps_error(err)
    return head + (f": {why}" if why and rc != 0 else "")



def rank_summary(rc: int | None, out: str, err: str, timeout: float) -> str:
    """One line for a rank-script job: exit code, rank 0's report, the first rejection."""
    if rc is None:
        return f"HANG: no exit within {timeout:.0f} s"
    reps = [r for r in rank_reports(out) if "metrics" in r]
    text = f"exit {rc}"
    if reps:
        r = reps[-1]
        text += (f", {r['steps']} steps, accuracy {r['metrics'].get('test_accuracy', float('nan')):.1f}%, "
                 f"rejected {r['rejected']}, skipped pushes {r['skipped']}")
    elif ps_error(err):
        text += f": {ps_error(err)}"
    lines = rejections(err)
    if lines:
        text += f"; server: '{lines[0]}'"
    return text

