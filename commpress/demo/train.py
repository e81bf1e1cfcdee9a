"""``commpress train``: time to accuracy on a communication-bound LM, dense vs fp16 vs commpress.

What the product is for, in one run: ``workers`` gloo ranks train the communication-bound
byte-level LM (:func:`~.workloads.wide_byte_lm`, 10.8M parameters, a 43 MB gradient) on
Python's standard-library sources with the user's ``AdamW(lr=1e-3)``, three times from the
same initialisation and data order: DDP's own all-reduce, PyTorch's ``fp16_compress_hook``,
and the commpress hook (default ``qsgd``: 4-bit QSGD, unbiased, no residuals; registered as
a user would, ``register(ddp, codec, optimizer=opt)``). Each run is :mod:`.runner` started
once per rank.

**The link.** As root with ``ip netns`` (:mod:`.shaped_net`), every rank is its own host on
a link shaped to ``link`` (default 1 Gbit/s): the times are measured. Otherwise (or with
``loopback=True``) the ranks talk over loopback, which is not communication-bound, and the
link's cost is a **projection**: each step's loopback time plus the time the link takes for
the bytes that rank sends (:class:`commpress.comm.costmodel.Link`, ``2(n-1)`` messages of
``alpha`` plus ``bytes * beta``: the ring all-reduce's cost for dense; no overlap with the
backward pass assumed).

It prints, per method, the bytes each rank sends per step, the held-out loss, the median step
time and the training time to dense's final held-out loss x 1.02, and saves a plot of
held-out loss against step and against training time (``<out>/train_demo.png``).
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import tempfile
from typing import Any

from ..codecs import get
from ..comm.costmodel import Link
from .shaped_net import ShapedNetwork

#: Time to target: dense's final held-out loss times this.
TARGET = 1.02
#: The PyTorch baselines, in the order they run.
BASELINES = {"allreduce": "dense all-reduce (DDP, no hook)", "fp16": "PyTorch fp16_compress_hook"}
#: Held-out evaluations per run (about 0.2 s each; excluded from the training time).
EVALS = 16
#: Seconds per message of the projected link (the cost model table's alpha).
LATENCY_S = 50e-6


def parse_link(link: str) -> float:
    """Gbit/s of a link in ``tc`` syntax (``1gbit``, ``10gbit``, ``500mbit``); ValueError otherwise."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(gbit|mbit)", link.strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--link expects a rate such as 1gbit, 10gbit or 500mbit, got {link!r}")
    return float(m.group(1)) * (1.0 if m.group(2) == "gbit" else 1e-3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def link_seconds(link: Link, bytes_sent: float, n: int) -> float:
    """Seconds ``link`` takes per step for a rank sending ``bytes_sent`` among ``n`` ranks.

    ``2(n-1) alpha + bytes_sent * beta``: for dense, whose ring all-reduce of ``B`` bytes sends
    ``2(n-1)/n B``, this is :meth:`Link.allreduce`.
    """
    return 0.0 if n < 2 else 2 * (n - 1) * link.alpha + bytes_sent * link.beta


def project(results: list[dict[str, Any]], link: Link, n: int) -> None:
    """Add the link's cost to loopback ``results`` in place: curve times and median step time."""
    for r in results:
        extra = link_seconds(link, r["claimed_wire_bytes_per_step"], n)
        r["loopback_step_s"] = r["median_step_s"]
        r["median_step_s"] = r["median_step_s"] + extra
        r["curve"] = [[step, t + step * extra, loss] for step, t, loss in r["curve"]]


def time_to_target(result: dict[str, Any], target: float) -> float | None:
    """Training seconds at the first held-out evaluation at or below ``target``; None if never."""
    return next((t for _, t, loss in result["curve"] if loss <= target), None)


def _launch(net: ShapedNetwork, workers: int, methods: list[str], steps: int, batch: int | None,
            timeout: float) -> dict[str, Any]:
    """One :mod:`.runner` process per host; rank 0's results."""
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    port = _free_port()

    def argv(rank: int) -> list[str]:
        cmd = [sys.executable, "-m", "commpress.demo.runner", "--rank", str(rank), "--world", str(workers),
               "--master", net.addr(0), "--port", str(port), "--workload", "lm", "--steps", str(steps),
               "--eval-every", str(max(1, steps // EVALS)), "--methods", ";".join(methods), "--out", out,
               "--progress", "--timeout", "300"]
        return cmd + (["--batch", str(batch)] if batch else [])

    try:
        codes = net.run(argv, timeout, env={"PYTHONUNBUFFERED": "1"})
        if any(codes):
            raise RuntimeError(f"a training rank failed (exit codes {codes}); see its output above")
        with open(out) as f:
            data: dict[str, Any] = json.load(f)
    finally:
        os.unlink(out)
    return data


def train_demo(codec: str, params: dict[str, Any], workers: int = 2, steps: int = 64, batch: int | None = None,
               out_dir: str = "out", link: str = "1gbit", loopback: bool = False, baseline: bool = True,
               timeout: float = 1200) -> dict[str, Any]:
    """Run the demo; print the table and return ``{"results", "rows", "plot", "shaped", "target"}``.

    ``baseline=False`` skips the two PyTorch runs (no time to target then).
    """
    if workers < 1 or steps < 3 or (batch is not None and batch < 1):
        raise ValueError("workers >= 1, steps >= 3 and batch >= 1 are required")
    gbit = parse_link(link)
    get(codec, **params)  # validate before starting any process
    name = codec + (":" + ",".join(f"{k}={v}" for k, v in params.items()) if params else "")
    labels = {**(BASELINES if baseline else {}), "cp-" + name: f"commpress {name}"}
    os.makedirs(out_dir, exist_ok=True)
    with ShapedNetwork(workers, link, quiet=True, loopback=loopback) as net:
        where = (f"{workers} ranks, each on its own emulated host, links shaped to {link} (tc tbf)" if net.shaped
                 else f"{workers} ranks over loopback ({net.why_not}); the {link} link is PROJECTED")
        print(f"commpress train: 10.8M-parameter byte LM, AdamW(lr=1e-3), {steps} steps per method, {where}",
              file=sys.stderr, flush=True)
        data = _launch(net, workers, list(labels), steps, batch, timeout)
        shaped = net.shaped
    results = data["results"]
    if not shaped:
        project(results, Link.from_gbit(gbit, LATENCY_S), workers)
    dense = next((r for r in results if r["method"] == "allreduce"), None)
    target = dense["final_loss"] * TARGET if dense else None
    rows = []
    for r in results:
        t = time_to_target(r, target) if target is not None else None
        rows.append({"label": labels[r["method"]], "method": r["method"], "wire_mb": r["claimed_wire_bytes_per_step"] / 1e6,
                     "loss": r["final_loss"], "step_s": r["median_step_s"], "loopback_step_s": r.get("loopback_step_s"),
                     "time_to_target_s": t})
    print_table(rows, data, workers, link, shaped, target)
    plot = os.path.join(out_dir, "train_demo.png")
    save_plot(results, labels, plot, workers, link, shaped, target)
    print(f"plot: {plot}")
    return {"results": results, "rows": rows, "plot": plot, "shaped": shaped, "target": target}


def print_table(rows: list[dict[str, Any]], data: dict[str, Any], workers: int, link: str, shaped: bool,
                target: float | None) -> None:
    """The demo's closing table and its one-line verdict."""
    params = data["results"][0]["params"]
    how = f"{link} links (shaped, measured)" if shaped else f"{link} links: PROJECTION (loopback + cost model)"
    print(f"\nbyte-level LM ({params:,} parameters), AdamW(lr={data['lr']:g}), {workers} ranks, "
          f"{data['steps']} steps, batch {data['batch']} per rank, {how}")
    if target is not None:
        print(f"target: dense's final held-out loss x {TARGET} = {target:.4f}")
    dense = next((r for r in rows if r["method"] == "allreduce"), None)
    proj = "" if shaped else " (proj.)"
    head = (f"{'method':<34} {'MB/step':>8} {'held-out loss':>13} {'step s' + proj:>14} "
            f"{'to target s' + proj:>19} {'vs dense':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        t = r["time_to_target_s"]
        tt = "n/a" if target is None else "not reached" if t is None else f"{t:.1f}"
        vs = f"{t / dense['time_to_target_s']:.2f}x" if t is not None and dense and dense["time_to_target_s"] else "-"
        print(f"{r['label']:<34} {r['wire_mb']:>8.2f} {r['loss']:>13.4f} {r['step_s']:>14.3f} {tt:>19} {vs:>8}")
    print("MB/step: bytes each rank sends per step (ring estimate for DDP's all-reduce and fp16; the hook's "
          "own count for commpress). Times: training wall clock, evaluation excluded.")
    if not shaped:
        print(f"PROJECTION: measured over loopback, which is not communication-bound; each step adds the time a "
              f"{link} link takes for its bytes (commpress.comm.costmodel.Link, alpha {LATENCY_S * 1e6:.0f} us, no "
              "overlap with backward). Run as root with `ip netns` to measure on shaped links instead.")
        for r in rows:
            print(f"  {r['label']}: loopback step {r['loopback_step_s']:.3f} s")
    cp = rows[-1]
    if dense and cp is not dense and dense["time_to_target_s"] and cp["time_to_target_s"]:
        print(f"\n{cp['label']} reached the target in {cp['time_to_target_s'] / dense['time_to_target_s']:.2f}x "
              f"dense's time{proj}, sending {dense['wire_mb'] / cp['wire_mb']:.1f}x fewer bytes per step.")


def save_plot(results: list[dict[str, Any]], labels: dict[str, str], path: str, workers: int, link: str,
              shaped: bool, target: float | None) -> None:
    """Held-out loss against step and against training time, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        a.plot([c[0] for c in r["curve"]], [c[2] for c in r["curve"]], label=labels[r["method"]])
        b.plot([c[1] for c in r["curve"]], [c[2] for c in r["curve"]], label=labels[r["method"]])
    a.set_xlabel("step")
    b.set_xlabel(f"training wall-clock time (s), {workers} ranks, {link}" + ("" if shaped else " (PROJECTED)"))
    for ax in (a, b):
        if target is not None:
            ax.axhline(target, color="grey", linestyle=":", linewidth=1, label=f"target (dense x {TARGET})")
        ax.set_ylabel("held-out loss (nats/byte)")
        ax.set_ylim(top=min(ax.get_ylim()[1], 4.0))
        ax.legend(fontsize=8)
    fig.suptitle(f"commpress train: 10.8M-parameter byte LM, AdamW, {link} links"
                 + (" (shaped)" if shaped else " (projection from loopback)"))
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":  # pragma: no cover - use `python -m commpress train`
    sys.exit("run `python -m commpress train --help`")
