"""Validate commpress's cost model against a bench_e2e speed run (--json) at one or more world sizes.

    python scripts/bench_e2e.py --ranks 2 4 --links unshaped 10gbit 1gbit --json RUN.json --methods \
        "allreduce;fp16;cp-topk:ratio=0.01;cp-sign;cp-qsgd;cp-auto;cp-auto:auto_codec=qsgd;cp-auto:auto_codec=topk,ratio=0.01"
    python scripts/costmodel_validate.py RUN.json

Every ``cp-auto`` run reports, per bucket, the seconds the model predicts for each option (link
calibrated in that network, device costs of its candidate codec). The ``dense`` / ``fp16``
predictions stand for PyTorch's all-reduce and fp16 hook, an auto run's ``compressed`` one for the
fixed method of its candidate (``cp-auto:auto_codec=qsgd`` -> ``cp-qsgd``; plain ``cp-auto`` -> its
default candidate when the hook owns SGD's momentum, as the speed workload's ``optimizer=`` gives
it: ``cp-topk:ratio=0.01`` at 2 ranks, ``cp-sign`` at 4), and each auto run's chosen options for
itself. Every round of a method list calibrates anew, so each prediction is the median over the
rounds' auto runs (an auto method's own: over its rounds, each with that round's choices), set
against the median measured step. The compute time ``C_w`` = measured dense step - predicted
dense reduction (unshaped, ``w`` ranks); predicted step = ``C_w`` + the sum over buckets. Prints a
markdown table with the error per row and the mean / max error.
"""

from __future__ import annotations

import json
import statistics
import sys


def fixed_method(auto_method: str, world: int) -> str:
    """The fixed method an auto run's ``compressed`` option stands for at ``world`` ranks."""
    params = dict(p.split("=", 1) for p in auto_method.partition(":")[2].split(",") if "=" in p)
    codec = params.pop("auto_codec", None)
    if codec is None:  # the speed workload passes SGD(momentum=0.9) as optimizer=: the hook owns the momentum
        from commpress.ddp.candidate import default_candidate

        codec, defaults, _ = default_candidate(None, momentum=0.9, world_size=world)
        params = {k: str(v) for k, v in defaults.items()}
    return f"cp-{codec}" + (":" + ",".join(f"{k}={v}" for k, v in params.items()) if params else "")


def results(run: dict) -> dict[str, dict]:
    """Method -> its first result, with the median of its repeats' median steps."""
    out: dict[str, dict] = {}
    steps: dict[str, list[float]] = {}
    for r in run["results"]:
        out.setdefault(r["method"], dict(r))
        steps.setdefault(r["method"], []).append(r["median_step_s"])
    for m, v in steps.items():
        out[m]["median_step_s"] = statistics.median(v)
    return out


def predictions(run: dict, world: int) -> dict[str, float]:
    """Predicted reduction seconds per method present in the run (compute excluded), median over rounds."""
    def total(report: list[dict], option: str) -> float:
        return sum(b["predicted_s"][option] for b in report if option in b["predicted_s"])

    per: dict[str, list[float]] = {}
    for r in run["results"]:
        m, report = r["method"], r.get("auto")
        if not m.startswith("cp-auto") or not report:
            continue
        per.setdefault("allreduce", []).append(total(report, "dense"))
        per.setdefault("fp16", []).append(total(report, "fp16"))
        per.setdefault(fixed_method(m, world), []).append(total(report, "compressed"))
        per.setdefault(m, []).append(sum(b["predicted_s"][b["option"]] for b in report))
    return {m: statistics.median(v) for m, v in per.items()}


def choices(run: dict, method: str) -> str:
    """An auto method's options per round, bucket by bucket (``compressed/dense; ...``)."""
    return "; ".join("/".join(b["option"] for b in r["auto"]) for r in run["results"]
                     if r["method"] == method and r.get("auto"))


def main(path: str) -> None:
    runs = {tuple(r["key"]): r for r in json.load(open(path))}
    worlds = sorted({k[1] for k in runs})
    compute = {}
    for w in worlds:
        rs = results(runs[("unshaped", w)])
        compute[w] = rs["allreduce"]["median_step_s"] - predictions(runs[("unshaped", w)], w)["allreduce"]
    print("| link | ranks | method | measured step (s) | predicted (s) | error |")
    print("|---|---|---|---|---|---|")
    errs = []
    for key, run in runs.items():
        rs = results(run)
        for m, v in predictions(run, key[1]).items():
            if m not in rs:
                continue
            measured, predicted = rs[m]["median_step_s"], compute[key[1]] + v
            err = predicted / measured - 1
            errs.append(abs(err))
            choice = f" ({choices(run, m)})" if m.startswith("cp-auto") else ""
            print(f"| {key[0]} | {key[1]} | {m}{choice} | {measured:.3f} | {predicted:.3f} | {100 * err:+.1f}% |")
    within = sum(e <= 0.15 for e in errs)
    print(f"\ncompute C per world size: {compute}; mean |error| {100 * sum(errs) / len(errs):.1f}%, "
          f"max {100 * max(errs):.1f}%; within 15%: {within} of {len(errs)}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1])
