"""Check ``commpress advise`` against the step times ``docs/benchmarks.md`` measured.

    python scripts/advise_validate.py            # lm and wide-digits, 2 ranks, 1 Gbit/s
    python scripts/advise_validate.py --tolerance 0.15

Reads the measured median step of every option from the time-to-accuracy tables of
``docs/benchmarks.md`` (``### lm: ...`` and ``### Communication-bound SGD workload (wide-digits)``,
their "2 ranks, 1gbit" table), runs the advice for the same workload, world size and link on
this machine (``commpress advise`` under torchrun with 2 local ranks: compute and codec costs
measured by both at once, as the benchmark's ranks shared the machine), and prints a markdown table of predicted
against measured with the error of each row. Rows whose run was not in its steady state are
listed and left out of the verdict: random-k with AdamW on the LM, where the divergence guard
ran dense windows (``docs/benchmarks.md``, "Random-k with AdamW"), so its median step is not a
compressed step. PowerSGD is not priced by the cost model. Run it on a quiet machine: the
measured tables were. Exit code 1 when a row is off by more than the tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


SECTIONS = {"lm": "### lm: byte-level LM", "wide-digits": "### Communication-bound SGD workload (wide-digits)"}
LABELS = {  # row label prefix in the docs -> advise's option
    "PyTorch all-reduce": "dense", "PyTorch fp16_compress_hook": "fp16", "commpress `topk": "topk",
    "commpress `sign": "sign", "commpress `qsgd": "qsgd", "commpress `randomk": "randomk", "commpress `auto": "auto",
}
NOT_STEADY = {("lm", "randomk"): "the divergence guard ran dense windows in the measured run"}


def measured_steps(doc: str, workload: str, table: str = "2 ranks, 1gbit") -> dict[str, float]:
    """Option -> measured median step (s) from the workload's ``table`` in ``doc``."""
    start = doc.index(SECTIONS[workload])
    text = doc[start:]
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
        option = next((o for prefix, o in LABELS.items() if cells[0].startswith(prefix)), None)
        if option is not None and "tuned" not in cells[0]:
            out[option] = float(cells[col])
    return out


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
    ap.add_argument("--workloads", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    ap.add_argument("--tolerance", type=float, default=0.15, help="largest relative error allowed (default 0.15)")
    args = ap.parse_args(argv)
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
        doc = f.read()
    print("| workload | option | measured step (s) | predicted step (s) | error |")
    print("|---|---|---|---|---|")
    worst, failed = 0.0, []
    for workload in args.workloads:
        measured = measured_steps(doc, workload)
        advice = advise_run(workload)
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
