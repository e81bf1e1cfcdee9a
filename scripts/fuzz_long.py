"""The long fuzz runs of issue #12: every target, one after the other, and a table of the results.

    python scripts/fuzz_long.py                       # 1,000,000 inputs per target
    python scripts/fuzz_long.py --runs 100000 --targets ps checkpoint --out /tmp/fuzz

Each target (``scripts/fuzz_<target>.py``) runs with ``--runs N --artifacts OUT/<target>``; its
log goes to ``OUT/<target>.log``. The table quotes, per target: inputs run, inputs/s, coverage
(``cov``: instrumented edges of commpress reached, ``ft``: features) and peak RSS from
libFuzzer's final lines, the slowest input from the harness, and the findings (crash, timeout
and out-of-memory inputs libFuzzer wrote, and the inputs kept as slower than ``--slow-ms``:
re-time those with ``scripts/fuzz_<target>.py --replay FILE`` to tell noise from a real cost).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = ("wire", "ps", "checkpoint")


def summarize(log: str, artifacts: str) -> dict[str, str]:
    """The table row of one target's log and artifacts directory."""
    def last(pattern: str) -> str:
        found = re.findall(pattern, log)
        return found[-1] if found else "?"

    kept = sorted(os.listdir(artifacts)) if os.path.isdir(artifacts) else []
    crashes = [k for k in kept if k.startswith(("crash-", "timeout-", "oom-", "leak-"))]
    return {
        "inputs": last(r"stat::number_of_executed_units:\s+(\d+)"),
        "inputs/s": last(r"stat::average_exec_per_sec:\s+(\d+)"),
        "cov": last(r"cov: (\d+)"),
        "ft": last(r"ft: (\d+)"),
        "peak RSS MB": last(r"stat::peak_rss_mb:\s+(\d+)"),
        "slowest ms": last(r"slowest (?:input so far: )?([\d.]+) ms"),
        "findings": str(len(crashes)) + (f" ({', '.join(crashes)})" if crashes else ""),
        "slow inputs kept": str(sum(k.startswith("slow-") for k in kept)),
    }


def main() -> int:
    """Run the targets and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=1_000_000)
    p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS)
    p.add_argument("--out", default=None, help="logs and artifacts (default: a new temporary directory)")
    args = p.parse_args()
    args.out = args.out or tempfile.mkdtemp(prefix="fuzz_long.")
    rows = {}
    for name in args.targets:
        artifacts = os.path.join(args.out, name)
        os.makedirs(artifacts, exist_ok=True)
        cmd = [sys.executable, os.path.join(ROOT, "scripts", f"fuzz_{name}.py"), "--runs", str(args.runs),
               "--artifacts", artifacts]
        print("$", " ".join(cmd), flush=True)
        with open(os.path.join(args.out, f"{name}.log"), "w") as f:
            rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": ROOT})
        with open(os.path.join(args.out, f"{name}.log")) as f:
            rows[name] = {**summarize(f.read(), artifacts), "exit": str(rc)}
    cols = list(next(iter(rows.values())))
    print("| target | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(row[c] for c in cols) + " |")
    return max(int(r["exit"]) != 0 for r in rows.values())


if __name__ == "__main__":
    sys.exit(main())
