"""Check ``commpress advise`` against measured step times.

    python scripts/advise_validate.py              # lm and wide-digits, 2 ranks, 1 Gbit/s, measured now
    python scripts/advise_validate.py --from-doc   # against the tables of docs/benchmarks.md instead
    python scripts/advise_validate.py --tolerance 0.15

By default it measures the median step of every option now, side by side with the advice
(``scripts/bench_e2e.py --tta`` on the same workload, 2 ranks, 1 Gbit/s shaped links, 120 steps:
past the 50 warm-up steps, so the median is a compressed step; about 9 min for both workloads):
prediction and measurement then see the same machine on the same day. ``--from-doc`` reads the
medians from the time-to-accuracy sections of ``docs/benchmarks.md`` instead (the
``<!-- tta-<workload>:start -->`` sections ``bench_e2e.py --tta`` writes, their "2 ranks, 1gbit"
table), which holds only when this machine is as fast as it was that day. It runs the advice for the same workload, world size and link on
this machine (``commpress advise`` under torchrun with 2 local ranks: compute and codec costs
measured by both at once, as the benchmark's ranks shared the machine), and prints a markdown table of predicted
against measured with the error of each row. Rows whose run was not in its steady state are
listed and left out of the verdict: random-k with AdamW on the LM, where the divergence guard
ran dense windows (``docs/benchmarks.md``, "Random-k with AdamW"), so its median step is not a
compressed step. PowerSGD is not priced by the cost model. Run it on a quiet machine. Exit code 1 when a row is off by more than the tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from bench_e2e import tta_markers  # noqa: E402  (scripts/ is not a package)

WORKLOADS = ["lm", "wide-digits"]
MEASURE_METHODS = "allreduce;fp16;cp-topk:ratio=0.01;cp-sign;cp-qsgd;cp-randomk:ratio=0.01"
MEASURE_STEPS = 120  # > 50 warm-up steps: the median is a compressed step
LABELS = {  # row label prefix in the docs -> advise's option
    "PyTorch all-reduce": "dense", "PyTorch fp16_compress_hook": "fp16", "commpress `topk": "topk",
    "commpress `sign": "sign", "commpress `qsgd": "qsgd", "commpress `randomk": "randomk", "commpress `auto": "auto",
}
NOT_STEADY = {("lm", "randomk"): "the divergence guard ran dense windows in the measured run"}


def _option(method_label: str) -> str | None:
    return next((o for prefix, o in LABELS.items() if method_label.startswith(prefix)), None)


def measured_steps(doc: str, workload: str, table: str = "2 ranks, 1gbit") -> dict[str, float]:
    """Option -> measured median step (s) from the workload's ``table`` in ``doc``."""
    start_marker, end_marker = tta_markers(workload)
    if start_marker not in doc:
        raise SystemExit(f"docs/benchmarks.md has no {start_marker} section: run "
                         f"`python scripts/bench_e2e.py --tta --workloads {workload} --ranks 2 --links 1gbit` first")
    text = doc[doc.index(start_marker):doc.index(end_marker)]
    if table not in text:
        raise SystemExit(f"the {workload} section of docs/benchmarks.md has no {table!r} table")
    text = text[text.index(table):]
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| method"))
    cols = [c.strip() for c in lines[head].strip("|").split("|")]
    col = cols.index("median step (s)")
    out: dict[str, float] = {}
    for line in lines[head + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        option = _option(cells[0])
        if option is not None and "tuned" not in cells[0]:
            out[option] = float(cells[col])
    return out


def measure_now(workload: str, world: int = 2, link: str = "1gbit", steps: int = MEASURE_STEPS) -> dict[str, float]:
    """Option -> median step (s) measured now by ``bench_e2e.py --tta`` (its doc and plot go to a temp dir)."""
    from bench_e2e import tta_label

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "runs.json")
        cmd = [sys.executable, os.path.join(HERE, "bench_e2e.py"), "--tta", "--workloads", workload, "--ranks", str(world),
               "--links", link, "--lm-steps", str(steps), "--digits-steps", str(steps), "--methods", MEASURE_METHODS,
               "--doc", os.path.join(tmp, "doc.md"), "--img", tmp, "--json", out]
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        with open(out) as f:
            runs = json.load(f)
    medians: dict[str, float] = {}
    for r in runs[0]["results"]:
        option = _option(tta_label(r["method"]))
        if option is not None:
            medians[option] = r["median_step_s"]
    return medians


def advise_run(workload: str, world: int = 2, link: str = "1gbit") -> dict:
    """``commpress advise --workload W`` on ``world`` local ranks (torchrun); its JSON."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "advice.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port", str(port),
               "-m", "commpress", "advise", "--workload", workload, "--link", link, "--plot", "", "--json", out]
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> int:
    """Print predicted vs measured per workload and option; exit 1 past the tolerance."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--workloads", nargs="+", default=WORKLOADS, choices=WORKLOADS)
    ap.add_argument("--from-doc", action="store_true",
                    help="compare with the tables of docs/benchmarks.md instead of measuring now")
    ap.add_argument("--tolerance", type=float, default=0.15, help="largest relative error allowed (default 0.15)")
    args = ap.parse_args(argv)
    doc = ""
    if args.from_doc:
        with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
            doc = f.read()
    print("| workload | option | measured step (s) | predicted step (s) | error |")
    print("|---|---|---|---|---|")
    worst, failed = 0.0, []
    for workload in args.workloads:
        advice = advise_run(workload)
        measured = measured_steps(doc, workload) if args.from_doc else measure_now(workload)
        options = {o["name"]: o for o in advice["options"]}
        for name, t in measured.items():
            pred = options[name]["step_s"]
            assert pred is not None
            err = pred / t - 1
            note = NOT_STEADY.get((workload, name))
            print(f"| {workload} | {name} | {t:.4f} | {pred:.4f} | {100 * err:+.1f}%"
                  + (f" (left out: {note})" if note else "") + " |")
            if note:
                continue
            worst = max(worst, abs(err))
            if abs(err) > args.tolerance:
                failed.append(f"{workload}/{name} {100 * err:+.1f}%")
        print(f"| {workload} | compute (measured here) | | {advice['compute_s']:.4f} | |")
    print(f"\nlargest error {100 * worst:.1f}% (tolerance {100 * args.tolerance:.0f}%)"
          + (f"; past it: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
