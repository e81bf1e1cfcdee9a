"""End-to-end benchmark: commpress against PyTorch's own hooks, on emulated shaped links.

For each link (unshaped, 10 Gbit/s, 1 Gbit/s) and world size (2, 4) it starts one training
rank per emulated host (scripts/shaped_net.py; loopback without root) and trains the
communication-heavy workload (a 17M-parameter MLP on scikit-learn digits) under every method,
then trains the quality workload (a byte-level transformer on Python's standard-library
sources) at 2 ranks on 1 Gbit/s links. It prints the tables, checks the goals, writes them
into docs/benchmarks.md (between the e2e markers) and saves PNG plots in docs/img/.

    sudo python scripts/bench_e2e.py            # full run (~15 min on 2 cores)
    python scripts/bench_e2e.py --quick         # a smaller matrix for a first look

``--tta`` measures time to accuracy instead, on workloads where one run serves both speed and
quality (``commpress.demo.runner``'s ``lm``: a 10.8M-parameter byte-level LM with the user's
AdamW, communication-bound at 1 Gbit/s; ``digits``: the 64-256-256-10 MLP with the user's
SGD(lr=0.1, momentum=0.9)). Each method trains from the same initialisation on the same
batches; the tables give held-out loss (and accuracy) at equal steps, the median step time and
the training time to dense's final loss x 1.02 (accuracy - 1 point), written between the tta
markers of docs/benchmarks.md, one section per workload (a run of one workload replaces only
its own), with a loss-vs-time plot per workload (docs/img/tta_<workload>.png):

    sudo python scripts/bench_e2e.py --tta           # 2 and 4 ranks on 1 Gbit/s, every method
    sudo python scripts/bench_e2e.py --tta --quick   # 2 ranks, 4 methods, fewer steps
    sudo python scripts/bench_e2e.py --tta --tuned "cp-sign@warmup_steps=50"   # plus a tuned row

``--nodes N --local-world-size L`` runs an emulated cluster instead: N hosts of L ranks each
(``ShapedNetwork(N, link, ranks_per_node=L)``; a node's ranks talk over its loopback, only
cross-node traffic passes the shaped link), torchrun's variables handed to every rank, and prints
per method the bytes each node really sent across nodes per step (its link's tx counter) next to
what the hook claims (hierarchical: its ranks' ``inter_bytes_wire``; flat: one rank's wire
bytes, as a ring crosses each node boundary once). Under torchrun's variables commpress detects
the layout: a flat commpress row needs ``@local_world_size=1``.

    sudo python scripts/bench_e2e.py --nodes 2 --local-world-size 2 --workloads digits --links 1gbit \
        --methods "allreduce;cp-topk:ratio=0.01@local_world_size=1;cp-topk:ratio=0.01@local_world_size=2"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from typing import Any

import torch
from tqdm import tqdm

from shaped_net import ShapedNetwork

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
METHODS = [
    "allreduce",
    "fp16",
    "powersgd",
    # error-feedback methods with DGC's momentum factor masking (measured on the quality
    # workload: top-k 1% +3.8% -> +2.7%, sign +14.6% -> +9.4% loss vs dense at 300 steps)
    "cp-topk:ratio=0.01@momentum_masking=true",
    "cp-topk:ratio=0.001@momentum_masking=true",
    "cp-randomk:ratio=0.01,scaled=false@momentum_masking=true",
    "cp-sign:block_size=256@momentum_masking=true",
    "cp-qsgd:bits=4",
    # codec="auto" (commpress.ddp.auto): dense, fp16 or its candidate per bucket (top-k 1% or sign,
    # whichever sends fewer bytes, when the hook owns the momentum, as here; QSGD without
    # optimizer=), from a cost model
    "cp-auto",
]
LABEL = {
    "allreduce": "PyTorch all-reduce (no hook)",
    "fp16": "PyTorch fp16_compress_hook",
    "powersgd": "PyTorch powerSGD_hook (rank 4, 1 bucket)",
}
START, END = "<!-- e2e:start -->", "<!-- e2e:end -->"


def label(method: str) -> str:
    return LABEL.get(method, "commpress " + method[3:].replace("@", " + "))


def with_warmup(method: str, steps: int) -> str:
    """``method`` with ``steps`` dense warm-up steps when it is a commpress method with options."""
    return f"{method},warmup_steps={steps}" if steps and method.startswith("cp-") and "@" in method else method


def launch(net: ShapedNetwork, world: int, workload: str, steps: int, eval_every: int, port: int,
           timeout: float, methods: list[str], extra: tuple[str, ...] = (), pin: bool = False) -> dict[str, Any]:
    """Run one rank per host (``extra``: more runner options); return rank 0's JSON.

    ``pin``: rank ``r`` runs on CPU ``r % cpu_count`` only (``taskset``), as if each host had its own.
    """
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name

    def argv(r: int) -> list[str]:
        cmd = [sys.executable, "-m", "commpress.demo.runner", "--rank", str(r), "--world", str(world),
               "--master", net.addr(0), "--port", str(port), "--workload", workload, "--steps", str(steps),
               "--eval-every", str(eval_every), "--methods", ";".join(methods), "--out", out,
               "--timeout", str(min(timeout, 300)), *extra]
        return ["taskset", "-c", str(r % (os.cpu_count() or 1)), *cmd] if pin else cmd

    codes = net.run(argv, timeout)
    if any(codes):
        raise SystemExit(f"a rank failed (exit codes {codes}); see its output above")
    with open(out) as f:
        data = json.load(f)
    os.unlink(out)
    return data


def speed_table(runs: dict[tuple[str, int], dict[str, Any]]) -> list[str]:
    lines = ["| link | ranks | method | median step (s) | vs all-reduce | wire MB/step claimed | measured | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for (link, world), data in runs.items():
        base = next(r for r in data["results"] if r["method"] == "allreduce")["median_step_s"]
        for r in data["results"]:
            measured = [m for m in r["measured_wire_bytes_per_step"] if m >= 0]
            meas = f"{sum(measured) / len(measured) / 1e6:.2f}" if measured else "n/a"
            lines.append(f"| {link} | {world} | {label(r['method'])} | {r['median_step_s']:.3f} | "
                         f"{base / r['median_step_s']:.2f}x | {r['claimed_wire_bytes_per_step'] / 1e6:.2f} | {meas} | "
                         f"{r['compression_ratio']:.1f}x |")
    return lines


def quality_table(data: dict[str, Any]) -> tuple[list[str], dict[str, float]]:
    dense = next(r for r in data["results"] if r["method"] == "allreduce")
    target = dense["final_loss"] * 1.02
    lines = [f"Target loss for 'time to target': dense final loss x 1.02 = {target:.4f}", "",
             "| method | final held-out loss | vs dense | median step (s) | train time to target (s) |",
             "|---|---|---|---|---|"]
    rel = {}
    for r in data["results"]:
        hit = next((t for _, t, loss in r["curve"] if loss <= target), None)
        rel[r["method"]] = r["final_loss"] / dense["final_loss"] - 1
        lines.append(f"| {label(r['method'])} | {r['final_loss']:.4f} | {100 * rel[r['method']]:+.2f}% | "
                     f"{r['median_step_s']:.3f} | {'not reached' if hit is None else f'{hit:.1f}'} |")
    return lines, rel


def goals(runs: dict[tuple[str, int], dict[str, Any]], rel_loss: dict[str, float], link: str) -> list[str]:
    """Check the product goals on the 1 Gbit/s links at 2 ranks; report gaps."""
    key = (link, 2)
    if key not in runs:
        return [f"(no {link} run at 2 ranks: goals not checked)"]
    res = {r["method"]: r for r in runs[key]["results"]}
    unshaped = {r["method"]: r for r in runs.get(("unshaped", 2), {"results": []})["results"]}
    base = res["allreduce"]["median_step_s"]
    psgd = res.get("powersgd")
    out = []
    for m, r in res.items():
        if not m.startswith("cp-"):
            continue
        speed = base / r["median_step_s"]
        parts = [f"{speed:.2f}x all-reduce ({'ok' if speed >= 4 else 'goal 4x'})"]
        if psgd:
            faster = r["median_step_s"] < psgd["median_step_s"]
            better = rel_loss.get(m, 1) <= rel_loss.get("powersgd", 1)
            parts.append(f"vs PowerSGD: {'faster' if faster else 'slower'}, loss {'<=' if better else '>'} "
                         f"({'ok' if faster and better else 'goal: faster at <= loss'})")
        if m in unshaped:
            slow = r["median_step_s"] / unshaped[m]["median_step_s"]
            parts.append(f"{slow:.2f}x its unshaped step ({'ok' if slow <= 1.3 else 'goal <= 1.3x'})")
        if m in rel_loss:
            parts.append(f"loss {100 * rel_loss[m]:+.2f}% vs dense ({'ok' if rel_loss[m] <= 0.02 else 'goal <= 2%'})")
        out.append(f"- {label(m)}: " + "; ".join(parts))
    return out


def plot(quality: dict[str, Any], runs: dict[tuple[str, int], dict[str, Any]], img_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(img_dir, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in quality["results"]:
        if r["curve"]:
            ax.plot([t for _, t, _ in r["curve"]], [loss for _, _, loss in r["curve"]], label=label(r["method"]))
    ax.set_xlabel("training wall-clock time (s), 2 ranks, 1 Gbit/s links")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_title("Byte-level LM on stdlib text: loss against time")
    ax.legend(fontsize=7)
    paths.append(os.path.join(img_dir, "e2e_loss_vs_time.png"))
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    fig, ax = plt.subplots(figsize=(9, 5))
    keys = list(runs)
    methods = [r["method"] for r in runs[keys[0]]["results"]]
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        times = {r["method"]: r["median_step_s"] for r in runs[key]["results"]}
        ax.bar([j + i * width for j in range(len(methods))], [times[m] for m in methods], width, label=f"{key[0]}, {key[1]} ranks")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(methods))], [label(m).replace("commpress ", "") for m in methods],
                  rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("median step time (s)")
    ax.set_title("17M-parameter MLP: step time per method and link")
    ax.legend(fontsize=7)
    paths.append(os.path.join(img_dir, "e2e_step_time.png"))
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    return paths


def _read(path: str) -> str:
    return open(path).read() if os.path.exists(path) else "# Benchmarks\n"


def write_doc(path: str, body: list[str], start: str = START, end: str = END, before: str | None = None) -> None:
    """Put ``body`` between the ``start`` and ``end`` markers of ``path``.

    Absent markers are inserted just before the ``before`` marker when the file has it, else
    appended: a run of one workload replaces that workload's section and nothing else.
    """
    text = _read(path)
    block = "\n".join([start, *body, end])
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    elif before is not None and before in text:
        at = text.index(before)
        text = text[:at] + block + "\n" + text[at:]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)


# ----- time to accuracy (--tta) -------------------------------------------------------------------
# Every commpress codec at its defaults, registered as a user would; baselines as PyTorch ships them.
TTA_METHODS = [
    "allreduce",
    "fp16",
    "powersgd",
    "cp-topk:ratio=0.01",
    "cp-sign",
    "cp-qsgd",
    "cp-randomk:ratio=0.01",
]
TTA_QUICK_METHODS = ["allreduce", "fp16", "cp-topk:ratio=0.01", "cp-sign"]
TTA_START, TTA_END = "<!-- tta:start -->", "<!-- tta:end -->"


def tta_markers(workload: str) -> tuple[str, str]:
    """The markers around one workload's time-to-accuracy section (read by scripts/advise_validate.py)."""
    return f"<!-- tta-{workload}:start -->", f"<!-- tta-{workload}:end -->"


LOSS_TARGET = 1.02  # time to dense's final held-out loss x 1.02
ACC_TARGET = 1.0  # time to dense's final held-out accuracy minus 1 point (digits)
TTA_WORKLOADS = {
    "lm": "byte-level LM, 10.8M parameters (2 blocks of width 160, MLP 16384 wide, 32-byte context; "
          "`commpress.demo.workloads.wide_byte_lm`) on stdlib text, the user's `AdamW(lr={lr})`, "
          "{batch} windows per rank and step; held-out loss over 128 fixed windows (4096 bytes)",
    "digits": "digits MLP 64-256-256-10 (83k parameters), the user's `SGD(lr={lr}, momentum=0.9)`, "
              "`bucket_cap_mb=1`, batch {batch} per rank (epochs over each rank's part); held-out: 360 images",
    "wide-digits": "the communication-bound SGD workload: digits MLP 64-4096-4096-10 (17M parameters, a 67 MB "
                   "gradient; `digits_mlp(4096, 4096)`), the user's `SGD(lr={lr}, momentum=0.9)`, batch {batch} per "
                   "rank (epochs over each rank's part); held-out: 360 images",
}


def tta_label(method: str, result: dict[str, Any] | None = None) -> str:
    """Row label: the baselines by name; commpress with its spec, how it was registered, and "tuned" for options."""
    if not method.startswith("cp-"):
        return label(method)
    spec, _, options = method[3:].partition("@")
    text = f"commpress `{spec}`" + (" + `optimizer=opt`" if result and result.get("optimizer_passed") else "")
    return text + (f" (tuned: `{options}`)" if options else " (defaults)")


def time_to(curve: list[list[float]], values: list[float], reached: Any) -> float | None:
    """Training seconds at the first evaluation whose value satisfies ``reached``, None if never."""
    return next((pt[1] for pt, v in zip(curve, values) if reached(v)), None)


def tta_table(data: dict[str, Any]) -> list[str]:
    """One run's table: quality at equal steps, step time, time to dense's final quality."""
    res = data["results"]
    dense = next(r for r in res if r["method"] == "allreduce")
    target = dense["final_loss"] * LOSS_TARGET
    digits = data["workload"] in ("digits", "wide-digits")
    acc_target = dense["final_accuracy"] - ACC_TARGET if digits else None
    head = "| method | held-out loss | vs dense |" + (" accuracy % | vs dense (points) |" if digits else "")
    head += " median step (s) | vs all-reduce | wire MB/step | time to loss target (s) | vs dense |"
    head += " time to accuracy target (s) |" if digits else ""
    lines = [f"Targets: held-out loss {target:.4f} (dense's final x {LOSS_TARGET})"
             + (f", accuracy {acc_target:.2f}% (dense's final - {ACC_TARGET:g} point)" if digits else "")
             + "; times are training wall-clock seconds (evaluation excluded) at the first evaluation "
             "that reaches the target.", "", head, "|" + "---|" * (head.count("|") - 1)]
    t_dense = time_to(dense["curve"], [c[2] for c in dense["curve"]], lambda v: v <= target)
    for r in res:
        loss = r["final_loss"]
        t = time_to(r["curve"], [c[2] for c in r["curve"]], lambda v: v <= target)
        row = f"| {tta_label(r['method'], r)} | {loss:.4f} | {100 * (loss / dense['final_loss'] - 1):+.2f}% |"
        if digits:
            row += f" {r['final_accuracy']:.2f} | {r['final_accuracy'] - dense['final_accuracy']:+.2f} |"
        row += (f" {r['median_step_s']:.4f} | {dense['median_step_s'] / r['median_step_s']:.2f}x |"
                f" {r['claimed_wire_bytes_per_step'] / 1e6:.3f} |")
        row += " not reached | - |" if t is None else f" {t:.1f} | {t / t_dense:.2f}x |" if t_dense else f" {t:.1f} | - |"
        if digits:
            ta = time_to(r["curve"], r["accuracy"], lambda v: v >= acc_target)
            row += " not reached |" if ta is None else f" {ta:.1f} |"
        lines.append(row)
    return lines


def tta_plot(runs: dict[tuple[str, str, int], dict[str, Any]], path: str) -> None:
    """Held-out loss against training wall-clock time, one panel per (workload, link, ranks)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(runs)
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4.5), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for r in runs[key]["results"]:
            ax.plot([c[1] for c in r["curve"]], [c[2] for c in r["curve"]], label=tta_label(r["method"]).replace("`", ""))
        workload, link, world = key
        ax.set_title(f"{workload}: {world} ranks, {link}")
        ax.set_xlabel("training wall-clock time (s)")
        ax.set_ylabel("held-out loss (nats)")
        if workload == "lm":
            ax.set_ylim(top=min(ax.get_ylim()[1], 4.0))
        ax.legend(fontsize=6)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def equal_samples_steps(steps_at_2: int, world: int) -> int:
    """Steps at ``world`` ranks that see as many samples as ``steps_at_2`` steps at 2 ranks."""
    return max(1, round(steps_at_2 * 2 / world))


def tta_main(args: argparse.Namespace) -> int:
    """Time to accuracy on the communication-bound workloads; tables into docs/benchmarks.md."""
    methods = args.methods.split(";") if args.methods else (TTA_QUICK_METHODS if args.quick else TTA_METHODS)
    methods += [m for m in args.tuned if m not in methods]
    if "allreduce" not in methods:
        raise SystemExit("--methods must include allreduce (the baseline)")
    links = args.links or ["1gbit"]
    ranks = args.ranks or ([2] if args.quick else [2, 4])
    digits_steps = args.digits_steps or (100 if args.quick else 240)
    steps = {"lm": args.lm_steps or (60 if args.quick else 200), "digits": digits_steps, "wide-digits": digits_steps}
    points = {"lm": 8, "digits": 24, "wide-digits": 24}  # held-out evaluations per run (the lm's cost about 0.3 s each)
    runs: dict[tuple[str, str, int], dict[str, Any]] = {}
    port = 29800
    shaped = True
    t0 = time.monotonic()
    configs = [(w, link, world) for w in args.workloads for link in links for world in ranks]
    for workload, link, world in tqdm(configs, desc="tta runs (workload x link x ranks)", file=sys.stderr):
        n = equal_samples_steps(steps[workload], world)
        with ShapedNetwork(world, None if link == "unshaped" else link) as net:
            shaped = net.shaped
            runs[(workload, link, world)] = launch(net, world, workload, n, max(1, n // points[workload]), port,
                                                   args.timeout, methods, ("--progress",))
        port += 1
    wall = time.monotonic() - t0
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"key": list(k), **v} for k, v in runs.items()], f)
    command = f"python scripts/bench_e2e.py {shlex.join(sys.argv[1:])}"
    intro = [
        "## Time to accuracy on communication-bound workloads",
        "",
        f"Measured with `python scripts/bench_e2e.py --tta ...` (the command of each table is under its heading); "
        f"torch {torch.__version__}, {os.cpu_count()} CPU cores, gloo, one thread per rank; links shaped with tc tbf "
        "in network namespaces (loopback when not root, said in the table's line). "
        "Every method trains the same model from the same initialisation on the same batches. Baselines: "
        "DDP's all-reduce, PyTorch's fp16_compress_hook and powerSGD_hook (rank 4, error feedback, warm start, "
        "one bucket). commpress rows without options are `commpress.ddp.register(ddp, name, **params)` at the "
        "codec's defaults, with `optimizer=opt` when `register` takes it (the row says so); rows marked "
        "tuned add the options shown. Wire MB/step: per rank, what the hook reports (ring all-reduce "
        "estimate for the baselines). Step counts are equal within a table; across world sizes every run "
        "sees the same number of samples (4 ranks train half the steps of 2 ranks).",
        "",
    ]
    if TTA_START not in _read(args.doc):
        write_doc(args.doc, intro, TTA_START, TTA_END)
    pngs = []
    for workload in args.workloads:
        first = next(v for k, v in runs.items() if k[0] == workload)
        png = os.path.join(args.img, f"tta_{workload.replace('-', '_')}.png")
        tta_plot({k: v for k, v in runs.items() if k[0] == workload}, png)
        pngs.append(png)
        body = [f"### {workload}: " + TTA_WORKLOADS[workload].format(lr=first["lr"], batch=first["batch"]), "",
                f"Command: `{command}` ({wall / 60:.1f} min for the whole run, {time.strftime('%Y-%m-%d')}; links "
                f"{'shaped with tc tbf' if shaped else 'NOT shaped (no root): loopback'}).", ""]
        for (w, link, world), data in runs.items():
            if w == workload:
                body += [f"{world} ranks, {link}, {data['steps']} steps:", "", *tta_table(data), ""]
        body.append(f"![{os.path.basename(png)}](img/{os.path.basename(png)})")
        print("\n".join(body))
        start, end = tta_markers(workload)
        write_doc(args.doc, body, start, end, before=TTA_END)
    print(f"\n[bench_e2e] {wall / 60:.1f} min; wrote {args.doc} and {', '.join(pngs)}", file=sys.stderr)
    return 0


# ----- an emulated cluster (--nodes, --local-world-size) -----------------------------------------
def cross_node_claim(r: dict[str, Any], node: int, hier_local: int, local: int) -> float:
    """What node ``node``'s ranks claim to send across nodes per step.

    Hierarchical (``hier_local`` = L): the node's ranks' ``inter_bytes_wire``, plus the flat collectives
    over every rank (``codec="auto"``'s dense and fp16 buckets: a rank's wire bytes beyond both
    levels) of one rank, as a ring crosses each node boundary once; flat: one rank's wire bytes.
    """
    first = node * local
    claimed = r["claimed_wire_bytes_per_step_by_rank"][first]
    if hier_local == 1:
        return claimed
    inter = r["inter_bytes_wire_per_step_by_rank"]
    intra = r.get("intra_bytes_wire_per_step_by_rank")  # absent in runs from before auto ran hierarchical
    flat = 0.0 if intra is None else max(claimed - inter[first] - intra[first], 0.0)
    return sum(inter[first : first + local]) + flat


def cluster_table(data: dict[str, Any], nodes: int, local: int) -> list[str]:
    """Cross-node bytes per node and step: the hook's claim against the node link's tx counter."""
    lines = ["| method | layout | claimed across nodes / node / step | measured (link tx) / node / step | measured / claimed |",
             "|---|---|---|---|---|"]
    for r in data["results"]:
        topo = r["topology"] or {"nodes": nodes * local, "local_world_size": 1}
        hier = topo["local_world_size"] > 1
        claimed = [cross_node_claim(r, n, local if hier else 1, local) for n in range(nodes)]
        meas = [sum(r["measured_wire_bytes_per_step"][n * local : (n + 1) * local]) / local for n in range(nodes)]
        if min(meas) < 0:
            measured_text, ratio = "n/a (link not readable)", "-"
        else:
            measured_text = ", ".join(f"{m:,.0f}" for m in meas)
            ratio = f"{sum(meas) / sum(claimed):.2f}" if sum(claimed) else "-"
        how = {"torchrun": "detected", "explicit": "local_world_size"}.get(topo.get("source", ""), "")
        layout = f"{topo['nodes']} x {topo['local_world_size']}, hierarchical ({how})" if hier else "flat"
        lines.append(f"| {label(r['method'])} | {layout} | {', '.join(f'{c:,.0f}' for c in claimed)} | "
                     f"{measured_text} | {ratio} |")
    return lines


def cluster_main(args: argparse.Namespace) -> int:
    """Train on ``--nodes`` emulated hosts of ``--local-world-size`` ranks; print measured vs claimed cross-node bytes."""
    methods = args.methods.split(";") if args.methods else ["allreduce", "cp-topk:ratio=0.01@local_world_size=1",
                                                            f"cp-topk:ratio=0.01@local_world_size={args.local_world_size}"]
    port = 29900
    for workload in args.workloads:
        steps = (args.lm_steps if workload == "lm" else args.digits_steps) or 30
        for link in args.links or ["1gbit"]:
            with ShapedNetwork(args.nodes, None if link == "unshaped" else link,
                               ranks_per_node=args.local_world_size) as net:
                data = launch(net, net.world_size, workload, steps, args.cluster_eval_every, port, args.timeout, methods,
                              extra=("--warmup", str(args.cluster_count_from)))
                shaped = net.shaped
            port += 1
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps({"key": [workload, link, args.nodes, args.local_world_size], **data}) + "\n")
            print(f"\n{workload}, {args.nodes} nodes x {args.local_world_size} ranks, {link} between nodes "
                  f"({'shaped' if shaped else 'NOT shaped: loopback, nothing measured'}), {data['steps']} steps "
                  f"(the first {args.cluster_count_from} not counted); bytes per step, node 0, node 1, ...:\n")
            print("\n".join(cluster_table(data, args.nodes, args.local_world_size)))
            if args.cluster_eval_every and any(r["method"] == "allreduce" for r in data["results"]):
                print("\n" + "\n".join(tta_table(data)))  # quality at equal steps, step time, time to dense's loss
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tta", action="store_true",
                    help="time to accuracy on the communication-bound workloads (lm, digits) instead of the speed/quality matrix")
    ap.add_argument("--quick", action="store_true",
                    help="a smaller matrix (--tta: 2 ranks, 4 methods, 60 LM / 100 digits steps)")
    ap.add_argument("--ranks", type=int, nargs="+", help="world sizes (default 2 4; --tta --quick: 2)")
    ap.add_argument("--links", nargs="+", help="default unshaped 10gbit 1gbit; --tta: 1gbit")
    ap.add_argument("--workloads", nargs="+", choices=["lm", "digits", "wide-digits"],
                    help="--tta (default lm digits) and --nodes (default digits) only (wide-digits: the "
                         "17M-parameter SGD workload, not run by default)")
    ap.add_argument("--lm-steps", type=int,
                    help="--tta: lm steps at 2 ranks (default 200, quick 60); N ranks train 2/N as many (same samples)")
    ap.add_argument("--digits-steps", type=int,
                    help="--tta: digits steps at 2 ranks (default 240 = 12 epochs, quick 100); N ranks: 2/N as many")
    ap.add_argument("--tuned", action="append", default=[], metavar="METHOD",
                    help="--tta: an extra commpress method with options (cp-spec@options), labelled tuned")
    ap.add_argument("--json", help="also write every run's raw results here")
    ap.add_argument("--steps", type=int, default=8, help="speed workload steps per method (2 untimed)")
    ap.add_argument("--quality-steps", type=int, default=300)
    ap.add_argument("--quality-warmup", type=int, default=50,
                    help="dense warm-up steps of the error-feedback methods in the quality run (0: none)")
    ap.add_argument("--methods", help="semicolon-separated methods (default: every method of the mode)")
    ap.add_argument("--doc", default=os.path.join(ROOT, "docs", "benchmarks.md"))
    ap.add_argument("--img", default=os.path.join(ROOT, "docs", "img"))
    ap.add_argument("--pin", action="store_true",
                    help="speed runs: pin rank r to CPU r %% cpu_count (steadier step times on a small host)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per launch before it is killed")
    ap.add_argument("--nodes", type=int, help="an emulated cluster of this many hosts (with --local-world-size)")
    ap.add_argument("--local-world-size", type=int, default=1,
                    help="--nodes: ranks per host; prints measured against claimed cross-node bytes per step "
                         "(--workloads, --links, --methods; steps: --digits-steps / --lm-steps, default 30)")
    ap.add_argument("--cluster-count-from", type=int, default=2, metavar="N",
                    help="--nodes: bytes per step and the median step count from step N (default 2; e.g. 52 to leave "
                         "out AdamW's 50 warm-up steps and see the steady state); time to target counts every step")
    ap.add_argument("--cluster-eval-every", type=int, default=0,
                    help="--nodes: held-out evaluation every N steps (0: none); with it, the time-to-target table too")
    args = ap.parse_args()
    if args.nodes:
        args.workloads = args.workloads or ["digits"]
        return cluster_main(args)
    args.workloads = args.workloads or ["lm", "digits"]
    if args.tta:
        return tta_main(args)
    args.ranks = args.ranks or [2, 4]
    args.links = args.links or ["unshaped", "10gbit", "1gbit"]
    if args.quick:
        args.ranks, args.links, args.steps, args.quality_steps = [2], ["unshaped", "1gbit"], 5, 120
    methods = (args.methods or ";".join(METHODS)).split(";")
    if "allreduce" not in methods:
        ap.error("--methods must include allreduce (the baseline)")
    if min(args.steps, args.quality_steps) <= 2:  # the runner's untimed warm-up steps
        ap.error(f"--steps and --quality-steps must exceed 2, got {args.steps} and {args.quality_steps}")
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    port = 29700
    configs = [(link, world) for link in args.links for world in args.ranks]
    shaped = True
    for link, world in tqdm(configs, desc="speed runs (link x ranks)", file=sys.stderr):
        with ShapedNetwork(world, None if link == "unshaped" else link) as net:
            shaped = net.shaped
            runs[(link, world)] = launch(net, world, "speed", args.steps, 0, port, args.timeout, methods,
                                         pin=args.pin)
        port += 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"key": list(k), **v} for k, v in runs.items()], f)
    qlink = "1gbit" if "1gbit" in args.links else args.links[-1]
    print(f"[bench_e2e] quality run: 2 ranks, {qlink}, {args.quality_steps} steps per method", file=sys.stderr)
    qmethods = {with_warmup(m, args.quality_warmup): m for m in methods}
    with ShapedNetwork(2, None if qlink == "unshaped" else qlink) as net:
        quality = launch(net, 2, "quality", args.quality_steps, max(1, args.quality_steps // 20), port,
                         args.timeout, list(qmethods))
    for r in quality["results"]:  # report under the speed runs' names
        r["method"] = qmethods[r["method"]]
    qlines, rel = quality_table(quality)
    pngs = plot(quality, runs, args.img)
    body = [
        "## End to end: commpress against PyTorch's hooks on shaped links",
        "",
        f"Command: `python scripts/bench_e2e.py {shlex.join(sys.argv[1:])}`; torch {torch.__version__}, "
        f"{os.cpu_count()} CPU cores, gloo; links {'shaped with tc tbf in network namespaces' if shaped else 'NOT shaped (no root): loopback'}.",
        "Speed workload: 17M-parameter MLP (digits), batch 64 per rank, median of the timed steps. "
        "Wire MB/step: per rank; 'claimed' is what the hook reports (ring all-reduce estimate for "
        "the baselines), 'measured' is the interface's tx counter. Every method trains with "
        "SGD(lr=0.05, momentum=0.9), passed to commpress as `optimizer=` (its momentum moves into the "
        "hook: DGC momentum correction; `auto` hands it back while every bucket is exact), no warm-up.",
        "",
        *speed_table(runs),
        "",
        f"Quality workload: byte-level transformer on stdlib text, 2 ranks, {qlink}, {args.quality_steps} steps"
        + (f"; the methods with options (`+ momentum_masking=true`) also train their first {args.quality_warmup} "
           "steps dense (`warmup_steps`), which the speed runs (steady state) leave out." if args.quality_warmup else "."),
        "",
        *qlines,
        "",
        f"Goals ({qlink}, 2 ranks):",
        "",
        *goals(runs, rel, qlink),
        "",
        *[f"![{os.path.basename(p)}](img/{os.path.basename(p)})" for p in pngs],
    ]
    print("\n".join(body))
    write_doc(args.doc, body)
    print(f"\n[bench_e2e] wrote {args.doc} and {', '.join(pngs)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
