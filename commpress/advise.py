"""``commpress advise``: should I turn it on? Predicted step time per option, before a run.

Given a model (a built-in workload, a ``module:function`` that builds one, or a parameter
count), a world size and a link, it prints for each option (DDP's dense all-reduce, PyTorch's
fp16 hook, each commpress codec at its defaults, ``auto``) the bytes one rank sends per step, the
predicted step time and where that time goes, and it saves a plot of the predicted speed-up over
dense against link bandwidth. The prediction is the calibrated cost model of
:mod:`commpress.comm.costmodel` applied to the buckets DDP would build, plus the compute time:

``step = compute + sum over buckets of predict(bucket)[option] + DDP's bucket copies``

- **Buckets**: the model's parameters in the order their gradients become ready (timed on one
  step for a built-in workload; else reverse registration order), grouped as DDP groups them
  (a first bucket of 1 MiB, then ``bucket_cap_mb``);
  a parameter is compressed under the default selection rule (matrices of 2+ dimensions with at
  least ``min_numel`` elements), as :func:`commpress.ddp.register` decides.
- **Device costs**: each codec's encode (through error feedback where it keeps residuals),
  decode, the fp16 cast, timed on this machine (:func:`~commpress.comm.costmodel.calibrate_device`,
  one thread, as one rank of the measured runs uses), on a buffer the size of the model's typical
  bucket (:func:`calibration_numel`: per-element costs grow once a buffer leaves the caches).
- **DDP's bucket copies**: two passes over the gradient (into the bucket, and back into the
  gradients), paid by every option; the "codec work" column includes them.
- **Link**: ``--link 1gbit`` (``alpha`` 50 us per message, ``beta`` from the bandwidth) or, under
  ``torchrun`` across the real machines, ``--calibrate`` (all-reduces timed on the group).
- **Compute**: forward, backward and the optimizer step timed here for a built-in workload
  (median of a few steps, one thread), ``--compute-ms`` for anything else (else the table is
  communication only, and says so).

It prices the steady state: a warm-up (the first steps of value-blind codecs and of the Adam
mode run 8-bit QSGD) and the divergence guard's dense windows are not in it. Where it breaks: it assumes no overlap of communication with backward (DDP overlaps the buckets
it can; on communication-bound workloads little is hidden) and one rank per core. Validated
against the measured step times of ``docs/benchmarks.md`` by ``scripts/advise_validate.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import codecs as codec_registry
from .codecs import Codec
from .comm import default_algorithm
from .comm.costmodel import (
    CALIBRATION_NUMEL,
    DeviceCost,
    Entry,
    Link,
    best,
    calibrate_device,
    compressed_plan,
    max_over_ranks,
    predict,
    wire_time,
)
from .errors import CodecError
from .selection import SelectionRule

#: DDP's first bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``) and its default cap.
FIRST_BUCKET_BYTES = 1 << 20
DEFAULT_BUCKET_CAP_MB = 25.0
#: The commpress codecs advised on, each at its defaults as ``register(ddp, name, **params)``.
CODECS: dict[str, dict[str, Any]] = {
    "topk": {"ratio": 0.01}, "sign": {}, "qsgd": {}, "randomk": {"ratio": 0.01, "scaled": False},
}
#: Built-in workloads (:class:`commpress.demo.runner.Workload`): the ones ``docs/benchmarks.md`` measures.
WORKLOADS = ("lm", "digits", "wide-digits")
#: Bandwidths (Gbit/s) of the speed-up plot.
PLOT_GBITS = tuple(10 ** (k / 4) for k in range(-4, 11))  # 0.1 .. 316 Gbit/s


@dataclass(frozen=True)
class ModelShape:
    """What the prediction needs of a model: its DDP buckets, compute seconds, its optimizer kind."""

    label: str
    buckets: tuple[tuple[Entry, ...], ...]
    compute_s: float | None  # None: not known (communication only)
    optimizer: str  # "sgd" (momentum moves into the hook), "adam" or "none"

    @property
    def numel(self) -> int:
        """Gradient elements per step."""
        return sum(e.numel for b in self.buckets for e in b)


@dataclass(frozen=True)
class Option:
    """One option's prediction for one step."""

    name: str
    bytes_sent: float  # per rank per step
    wire_s: float
    work_s: float  # encode, decode, passes, casts: the device's part of the reduction
    step_s: float | None  # compute + wire + work; None when compute is unknown
    choices: dict[str, int] = dataclasses.field(default_factory=dict)  # auto: buckets per option

    @property
    def reduce_s(self) -> float:
        """Seconds of the gradient reduction (wire + work)."""
        return self.wire_s + self.work_s


def ddp_buckets(named: Sequence[tuple[str, tuple[int, ...]]], bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
                rule: SelectionRule | None = None, element_size: int = 4,
                ready_order: bool = False) -> tuple[tuple[Entry, ...], ...]:
    """Entries per bucket, as DDP groups parameters ``(name, shape)`` given in registration order.

    DDP fills buckets greedily in the order gradients become ready: the first bucket closes past
    :data:`FIRST_BUCKET_BYTES`, the others past ``bucket_cap_mb`` (one dtype and device). That
    order is the reverse of registration until the first backward, after which DDP rebuilds the
    buckets in the order it saw; pass that order with ``ready_order=True`` (:func:`gradient_order`).
    """
    rule = rule or SelectionRule()
    cap = int(bucket_cap_mb * (1 << 20))
    buckets: list[tuple[Entry, ...]] = []
    current: list[Entry] = []
    size = 0
    for name, shape in (named if ready_order else reversed(named)):
        numel = math.prod(shape)
        current.append(Entry(numel, rule(name, shape, numel)))
        size += numel * element_size
        if size >= (FIRST_BUCKET_BYTES if not buckets else cap):
            buckets.append(tuple(current))
            current, size = [], 0
    if current:
        buckets.append(tuple(current))
    return tuple(buckets)


def gradient_order(model: nn.Module, step: Callable[[], None]) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of ``model``'s parameters in the order ``step()``'s backward made their gradients."""
    order: list[tuple[str, tuple[int, ...]]] = []
    handles = [p.register_post_accumulate_grad_hook(lambda p, n=n: order.append((n, tuple(p.shape))))
               for n, p in model.named_parameters() if p.requires_grad]
    try:
        step()
    finally:
        for h in handles:
            h.remove()
    seen = {n for n, _ in order}  # parameters without a gradient this step go last, as DDP leaves them
    return order + [(n, tuple(p.shape)) for n, p in reversed(list(model.named_parameters())) if n not in seen]


def optimizer_kind(optimizer: torch.optim.Optimizer | None) -> str:
    """``"sgd"``, ``"adam"`` or ``"none"``: what the hook can do with the user's optimizer."""
    from .optim import is_adam_like, is_sgd_like

    if optimizer is None:
        return "none"
    return "adam" if is_adam_like(optimizer) else "sgd" if is_sgd_like(optimizer) else "none"


def time_compute(step: Callable[[], None], reps: int = 15, warmup: int = 3) -> float:
    """Median seconds of ``step()`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def workload_shape(kind: str, measure: bool = True, group: Any = None) -> ModelShape:
    """A built-in workload's buckets, its compute time on this machine (one thread) and optimizer.

    Under a process group every rank times the step at once and the slowest counts (ranks that
    share a machine also share its memory bandwidth, as in the measured runs).
    """
    from .demo.runner import Workload

    work = Workload(kind, rank=0)
    model = work.model()
    opt = work.optimizer(model.parameters())
    counter = iter(range(1 << 30))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        work.loss(model, next(counter)).backward()
        opt.step()

    with _threads(1):
        named = gradient_order(model, step)  # DDP's buckets after its rebuild follow this order
        compute = time_compute(step) if measure else None
    if compute is not None and group is not None:
        compute = max_over_ranks([compute], group)[0]
    nparams = sum(math.prod(s) for _, s in named)
    return ModelShape(f"{kind} ({nparams / 1e6:.2f}M parameters, {type(opt).__name__})",
                      ddp_buckets(named, work.bucket_cap_mb, ready_order=True), compute, optimizer_kind(opt))


def module_shape(spec: str, optimizer: str, bucket_cap_mb: float) -> ModelShape:
    """``package.module:function`` -> the buckets of the module ``function()`` returns."""
    mod_name, _, fn_name = spec.partition(":")
    if not mod_name or not fn_name:
        raise CodecError(f"--model expects package.module:function, got {spec!r}")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise CodecError(f"--model {spec!r}: {exc}") from None
    model = fn()
    if not isinstance(model, nn.Module):
        raise CodecError(f"--model {spec!r} returned {type(model).__name__}, not a torch.nn.Module")
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise CodecError(f"--model {spec!r} has no trainable parameters")
    nparams = sum(math.prod(s) for _, s in named)
    return ModelShape(f"{spec} ({nparams / 1e6:.2f}M parameters)", ddp_buckets(named, bucket_cap_mb), None, optimizer)


def count_shape(count: str, optimizer: str, bucket_cap_mb: float) -> ModelShape:
    """``--params 10.8M``: that many parameters as 4096-wide matrices (compressed) and a 1-D tail."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmb]?)", count.strip().lower())
    if not m:
        raise CodecError(f"--params expects a count such as 10.8M, 350k or 1.3B, got {count!r}")
    n = int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9}[m.group(2)])
    if n < 1:
        raise CodecError(f"--params must be at least 1, got {count!r}")
    side = 4096
    full, rest = divmod(n, side * side)
    named: list[tuple[str, tuple[int, ...]]] = [(f"w{i}", (side, side)) for i in range(full)]
    if rest >= side:
        named.append(("rest", (rest // side, side)))
    if rest % side:
        named.append(("tail", (rest % side,)))
    return ModelShape(f"{n / 1e6:.2f}M parameters", ddp_buckets(named, bucket_cap_mb), None, optimizer)


def calibration_numel(shape: ModelShape) -> int:
    """Elements to calibrate the device costs at: the bucket size a typical gradient element is in.

    Per-element costs grow with the buffer once it leaves the caches: measured on this project's
    CI machine (one thread), top-k's encode through error feedback took 1.10 ns per element at
    4M elements and 1.71 at 16.8M, sign's 0.61 and 0.98, a copy 0.29 and 0.52; calibrated at a
    fixed 4M, advise predicted the 17M MLP's compressed steps (one 16.8M-element bucket) 18-29%
    short. So: the element-weighted median of the buckets' sizes, within [2^20, 2^25].
    """
    sizes = sorted(sum(e.numel for e in b) for b in shape.buckets)
    if not sizes:
        return CALIBRATION_NUMEL
    half, seen = sum(sizes) / 2, 0
    for size in sizes:
        seen += size
        if seen >= half:
            break
    return min(max(size, 1 << 20), 1 << 25)


def device_costs(world: int, optimizer: str, numel: int | None = None,
                 group: Any = None) -> dict[str, DeviceCost]:
    """Calibrated per-element costs of each advised codec on this machine (one thread).

    Under a process group of 2+ ranks, each codec's encode and decode are then rescaled to the
    whole compressed path run on the group (:func:`~commpress.comm.costmodel.calibrate_compressed`,
    what ``codec="auto"`` does): frames, fresh buffers and the collectives' CPU work cost more
    than the codec timed alone (measured here: sign's encode 2-3x).
    """
    import torch.distributed as dist

    from .comm.costmodel import calibrate_compressed, calibrate_link

    numel = numel or CALIBRATION_NUMEL
    on_group = group is not None and dist.get_world_size(group) >= 2
    out = {}
    with _threads(1):
        local = calibrate_link(group) if on_group else None  # this group's own link, for the path's wire time
        for name, params in CODECS.items():
            codec = codec_registry.get(name, **params)
            feedback = not codec.unbiased  # error feedback's default (commpress.options)
            cost = calibrate_device(codec, feedback=feedback, momentum=optimizer == "sgd" and feedback,
                                    group=group, numel=numel)
            if local is not None:
                n = dist.get_world_size(group)
                # 9 runs, not auto's 5: advise runs once, before training, and can afford a steadier median
                cost = calibrate_compressed(codec, default_algorithm(codec, n), local, cost, feedback=feedback,
                                            group=group, numel=numel, reps=9)
            out[name] = cost
    return out


def auto_candidate(optimizer: str, world: int) -> str:
    """The codec ``auto`` compresses with here (:func:`commpress.ddp.candidate.default_candidate`)."""
    from .ddp.candidate import default_candidate

    probe: torch.optim.Optimizer | None = None
    p = [nn.Parameter(torch.zeros(1))]
    if optimizer == "sgd":
        probe = torch.optim.SGD(p, lr=0.1, momentum=0.9)
    elif optimizer == "adam":
        probe = torch.optim.AdamW(p, lr=1e-3)
    return default_candidate(probe, world_size=world)[0]


def advise(shape: ModelShape, world: int, link: Link, costs: dict[str, DeviceCost]) -> list[Option]:
    """Predicted cost of one step per option (dense, fp16, each codec, auto), in that order."""
    if world < 2:
        raise CodecError(f"advise needs a world size of at least 2 ranks, got {world}")
    ring = 2 * (world - 1) / world  # bytes a ring all-reduce sends per byte of input

    def dense_like(entries: Sequence[Entry], half: bool) -> tuple[float, float]:  # (bytes sent, wire s)
        nbytes = (2 if half else 4) * sum(e.numel for e in entries)
        return ring * nbytes, link.allreduce(nbytes, world)

    def compressed(entries: Sequence[Entry], codec: Codec, alg: str) -> tuple[float, float]:
        plan = compressed_plan(entries, codec, alg, world)
        return wire_time(Link(0.0, 1.0), plan, world), wire_time(link, plan, world)

    # DDP copies every gradient into its bucket and the reduced bucket back (gradient_as_bucket_view
    # is off by default), whatever the hook: two passes over the gradient that the compute timing
    # (no DDP) does not see; left out, every option of the 17M MLP was predicted ~17 ms short
    bucket_copies = 2 * next(iter(costs.values())).pass_s * shape.numel

    def option(name: str, parts: list[tuple[float, float, float]], choices: dict[str, int] | None = None) -> Option:
        sent, wire, total = (sum(p[i] for p in parts) for i in range(3))  # per bucket: bytes, wire s, predicted s
        total += bucket_copies
        step = None if shape.compute_s is None else shape.compute_s + total
        return Option(name, sent, wire, max(total - wire, 0.0), step, choices or {})

    per_codec = {}
    for name, params in CODECS.items():
        codec = codec_registry.get(name, **params)
        alg = default_algorithm(codec, world)
        per_codec[name] = (codec, alg, [predict(b, world, link, costs[name], codec, alg) for b in shape.buckets])
    base = next(iter(per_codec.values()))[2]  # dense and fp16 do not depend on the codec's costs
    out = [option("dense", [(*dense_like(b, False), p["dense"]) for b, p in zip(shape.buckets, base)]),
           option("fp16", [(*dense_like(b, True), p.get("fp16", p["dense"])) for b, p in zip(shape.buckets, base)])]
    for name, (codec, alg, per) in per_codec.items():
        out.append(option(name, [(*compressed(b, codec, alg), p["compressed"]) for b, p in zip(shape.buckets, per)]))
    # auto: every bucket takes the option predicted fastest (buckets with nothing to compress: dense or fp16)
    cand = auto_candidate(shape.optimizer, world)
    codec, alg, per = per_codec[cand]
    parts, picks = [], []
    for b, p in zip(shape.buckets, per):
        pick = best(p if any(e.compressed for e in b) else {k: v for k, v in p.items() if k != "compressed"})
        picks.append(cand if pick == "compressed" else pick)
        parts.append((*(compressed(b, codec, alg) if pick == "compressed" else dense_like(b, pick == "fp16")), p[pick]))
    out.append(option("auto", parts, {k: picks.count(k) for k in dict.fromkeys(picks)}))
    return out


def reason(opt: Option, dense: Option, compute_s: float | None) -> str:
    """Why an option is where it is, in a few words."""
    if opt.name == "dense":
        parts = [f"{opt.wire_s / max(opt.reduce_s, 1e-12):.0%} of its reduction on the wire"]
    else:
        parts = [f"{dense.bytes_sent / max(opt.bytes_sent, 1.0):.1f}x fewer bytes than dense"]
        if opt.work_s > opt.wire_s:
            parts.append("codec work dominates the reduction")
    if compute_s is not None and opt.step_s is not None:
        parts.append("compute-bound" if compute_s > opt.reduce_s else "communication-bound")
    if opt.choices:
        parts.append("buckets: " + ", ".join(f"{n} {k}" for k, n in opt.choices.items()))
    return "; ".join(parts)


def format_table(shape: ModelShape, world: int, link: Link, options: list[Option], how_link: str) -> str:
    """The advice as a markdown table with a recommendation line."""
    dense = options[0]
    compute = "unknown (pass --compute-ms)" if shape.compute_s is None else f"{shape.compute_s:.4f} s (measured here)"
    lines = [f"commpress advise: {shape.label}, {world} ranks, {how_link} "
             f"({link.gbit:.3g} Gbit/s, alpha {link.alpha * 1e6:.0f} us); {len(shape.buckets)} DDP buckets; "
             f"compute per step {compute}", ""]
    step_head = "predicted step (s) | vs dense |" if shape.compute_s is not None else "predicted reduction (s) | vs dense |"
    lines += [f"| option | MB/step per rank | wire (s) | codec work (s) | {step_head} reason |",
              "|---|---|---|---|---|---|---|"]
    for o in options:
        t = o.step_s if o.step_s is not None else o.reduce_s
        t_dense = dense.step_s if dense.step_s is not None else dense.reduce_s
        label = o.name if o.name in ("dense", "fp16", "auto") else f"{o.name}" + (
            f" ({', '.join(f'{k}={v}' for k, v in CODECS[o.name].items())})" if CODECS[o.name] else "")
        lines.append(f"| {label} | {o.bytes_sent / 1e6:.3f} | {o.wire_s:.4f} | {o.work_s:.4f} | {t:.4f} | "
                     f"{t_dense / max(t, 1e-12):.2f}x | {reason(o, dense, shape.compute_s)} |")
    fastest = min(options, key=lambda o: o.step_s if o.step_s is not None else o.reduce_s)
    lines += ["", f"fastest predicted: {fastest.name}. " + _caveat(fastest.name, shape.optimizer)]
    return "\n".join(lines)


def _caveat(name: str, optimizer: str) -> str:
    """What the speed does not say: how the option trains (from the measured tables)."""
    if name in ("dense", "fp16"):
        return "Compression would not pay here: keep DDP's all-reduce (or the fp16 hook)."
    if name in ("qsgd", "auto"):
        return "QSGD is unbiased and keeps no residuals: safe under any optimizer."
    if optimizer == "none":
        return f"{name} uses error feedback: pass your optimizer (or let register() find it) so its momentum moves into the hook."
    return f"{name} uses error feedback; register() adopts your optimizer's momentum (docs/benchmarks.md has its loss)."


def plot_speedup(shape: ModelShape, world: int, latency_s: float, costs: dict[str, DeviceCost], path: str) -> None:
    """Save the predicted speed-up over dense of every option against link bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[float]] = {}
    for g in PLOT_GBITS:
        opts = advise(shape, world, Link.from_gbit(g, latency_s), costs)
        key = "step_s" if shape.compute_s is not None else "reduce_s"
        dense = getattr(opts[0], key)
        for o in opts[1:]:
            series.setdefault(o.name, []).append(dense / max(getattr(o, key), 1e-12))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, ys in series.items():
        ax.plot(PLOT_GBITS, ys, label=name, linestyle="--" if name == "auto" else "-")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("link bandwidth per rank (Gbit/s)")
    ax.set_ylabel("predicted speed-up over dense" + (" (step)" if shape.compute_s is not None else " (reduction)"))
    ax.set_title(f"{shape.label}, {world} ranks")
    ax.legend(fontsize=8)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


class _threads:
    """``torch.set_num_threads(n)`` for a block (the measured runs give each rank one thread)."""

    def __init__(self, n: int) -> None:
        self.n, self.old = n, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.old)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The ``commpress advise`` options (on ``parser`` when given)."""
    p = parser or argparse.ArgumentParser(prog="commpress advise", description=__doc__.split("\n", 1)[0])
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--workload", choices=WORKLOADS, help="a built-in workload of docs/benchmarks.md (compute measured here)")
    what.add_argument("--model", metavar="MODULE:FUNCTION", help="a function returning your torch.nn.Module")
    what.add_argument("--params", metavar="COUNT", help="a parameter count, e.g. 10.8M, 350M, 1.3B")
    p.add_argument("--world", type=int, help="ranks (default: the torchrun group's size, else 2)")
    p.add_argument("--link", default="1gbit", help="link per rank in tc syntax: 1gbit (default), 10gbit, 500mbit")
    p.add_argument("--latency-us", type=float, default=50.0, help="seconds per message of the link, in us (default 50)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure the link with all-reduces on the process group (run under torchrun)")
    p.add_argument("--optimizer", choices=("sgd", "adam", "none"), default="sgd",
                   help="--model/--params: your optimizer as the hook sees it (sgd: momentum moves into the hook)")
    p.add_argument("--compute-ms", type=float, help="forward + backward + optimizer step per rank (ms), if known")
    p.add_argument("--bucket-cap-mb", type=float, default=DEFAULT_BUCKET_CAP_MB, help="DDP's bucket_cap_mb (default 25)")
    p.add_argument("--plot", default="out/advise.png", help="where to save the speed-up plot ('' for none)")
    p.add_argument("--json", metavar="PATH", help="also write the predictions as JSON")
    p.add_argument("--calibration-numel", type=int, help=argparse.SUPPRESS)  # tests: a smaller device calibration
    return p


def main(argv: list[str] | None = None) -> int:
    """``commpress advise ...``: print the table (rank 0), save the plot; return the exit code.

    Under ``torchrun`` every rank measures compute and codec costs at the same time and the
    slowest counts (``--calibrate`` also times the group's link); otherwise one process does.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    from .demo.train import parse_link

    if args.world is not None and args.world < 2:
        parser.error(f"--world must be at least 2, got {args.world}")
    if args.compute_ms is not None and not (0 <= args.compute_ms < math.inf):
        parser.error(f"--compute-ms must be a finite number >= 0, got {args.compute_ms}")
    if args.bucket_cap_mb <= 0:
        parser.error(f"--bucket-cap-mb must be > 0, got {args.bucket_cap_mb}")
    try:
        gbit = parse_link(args.link)
    except ValueError as exc:
        parser.error(str(exc))
    if args.calibrate and "WORLD_SIZE" not in os.environ:
        parser.error("--calibrate times the link on a process group: run under torchrun "
                     "(torchrun --nnodes 2 --nproc-per-node 1 ... -m commpress advise --calibrate ...)")
    group, rank, world = _group_from_torchrun()
    try:
        if args.workload:
            shape = workload_shape(args.workload, measure=args.compute_ms is None, group=group)
        elif args.model:
            shape = module_shape(args.model, args.optimizer, args.bucket_cap_mb)
        else:
            shape = count_shape(args.params, args.optimizer, args.bucket_cap_mb)
    except CodecError as exc:
        parser.error(str(exc))
    if args.compute_ms is not None:
        shape = dataclasses.replace(shape, compute_s=args.compute_ms / 1e3)
    world = args.world or world or 2
    if args.calibrate:
        from .comm.costmodel import calibrate_link

        link, how = calibrate_link(group), "link calibrated on the process group"
    else:
        link, how = Link.from_gbit(gbit, args.latency_us * 1e-6), f"--link {args.link}"
    costs = device_costs(world, shape.optimizer, args.calibration_numel or calibration_numel(shape), group)
    options = advise(shape, world, link, costs)
    if rank == 0:
        print(format_table(shape, world, link, options, how))
        if args.plot:
            plot_speedup(shape, world, link.alpha, costs, args.plot)
            print(f"plot: {args.plot}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": shape.label, "world": world, "link_gbit": link.gbit, "alpha_s": link.alpha,
                           "compute_s": shape.compute_s, "buckets": len(shape.buckets),
                           "options": [dataclasses.asdict(o) for o in options]}, f, indent=1)
    if group is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


def _group_from_torchrun() -> tuple[Any, int, int | None]:
    """Under torchrun: a gloo group (every rank measures at once); else ``(None, 0, None)``."""
    if "WORLD_SIZE" not in os.environ:
        return None, 0, None
    import torch.distributed as dist

    dist.init_process_group("gloo")  # the costs are the CPU's; calibrate_link times gloo too
    return dist.group.WORLD, dist.get_rank(), dist.get_world_size()


if __name__ == "__main__":
    sys.exit(main())
