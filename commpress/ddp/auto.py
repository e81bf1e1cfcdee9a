"""``codec="auto"``: per DDP bucket, reduce dense, as fp16 or compressed, whichever is predicted fastest.

``commpress.ddp.register(ddp, "auto", optimizer=opt)`` (or ``CompressionState(model, "auto")``)
builds the state of the *candidate* codec (``auto_codec``, default below; codec parameters as
usual, e.g. ``auto_codec="topk", ratio=0.01``) and attaches an :class:`AutoPolicy`:

1. **Calibrate** (at registration, after the configuration check; a collective): fit the link's
   ``alpha``/``beta`` from timed all-reduces of a few sizes, time the candidate's encode and
   decode on this device, then the fp16 cast all-reduce and the candidate's whole compressed
   path once on the group (:mod:`commpress.comm.costmodel`); the measurements are all-reduced
   with MAX, so every rank holds the same numbers and takes the same decisions (~0.3-1.8 s on
   the 17M-parameter benchmark's links).
2. **Decide** each bucket at its first hook call (its sizes are known then: ``state.bucket_plan``):
   dense, unless the option with the least predicted time
   (:func:`~commpress.comm.costmodel.predict`) beats dense by ``auto_margin`` (close calls stay
   exact: measured on the 17M MLP, the model underestimates every other option's CPU work).
3. **Re-decide** every ``auto_interval`` steps (default 100) from the running measurements:
   the seconds the compressed buckets really spent encoding and decoding (the collectives'
   ``encode_s``/``decode_s`` counters, all-reduced with MAX over ranks) rescale the device costs
   of the model, every bucket is predicted again, and a bucket switches only when another option
   is predicted at least ``auto_margin`` (default 10%) faster than its current one; every switch
   of a bucket doubles the margin it needs for the next (hysteresis: it cannot oscillate).
   Each bucket's measured time (hook call to decoded average, per option it ran with, MAX over
   ranks) is reported next to its prediction but does not decide: under DDP it includes waiting
   behind the other buckets' collectives and for backward's compute (on loopback a 70 KB bucket
   measured 6-11 ms against 1.4 ms predicted), which no option changes.

**Several nodes.** On a hierarchical layout (``local_world_size=``, or torchrun's variables:
:mod:`commpress.comm.topology`) ``compressed`` is the hierarchical path (dense in the node, the
candidate across nodes on each rank's share: :mod:`commpress.comm.hierarchical`) while ``dense``
and ``fp16`` stay DDP's flat all-reduces over every rank. Calibration then fits three links (the
whole group's, the node's, across nodes: :class:`~commpress.comm.costmodel.NodeLinks`), each on its
own group, MAX over every rank, and :func:`~commpress.comm.costmodel.predict_hierarchical` prices
the options: on a fast network flat dense wins, on a slow one the hierarchy's ``1/L`` share across
nodes does, and where the node's own links are slow (TCP over loopback on an emulated cluster) the
node's two dense stages count against it. ``auto_link`` is then the link across nodes (and the flat
one); the node's link is always measured.

Error feedback is carried across switches: a bucket that goes dense or fp16 after compressed
steps first flushes its residuals into the gradient (:meth:`CompressionState.flush_residuals`, as
the divergence guard's dense steps do), so nothing held back is lost; compressing again starts
from empty residuals. Warm-up and the guard's dense steps are dense as before. While every bucket
is exact (dense or fp16, residuals flushed: :meth:`AutoPolicy.all_exact`), SGD momentum taken from
``optimizer=`` goes back to the optimizer (:meth:`CompressionState.place_momentum`), so a
dense-only ``auto`` runs SGD's own momentum instead of the hook's velocity update (6-7% of a step on
the 17M MLP, ``scripts/bench_hook_overhead.py``); the hook takes it back before a bucket compresses. ``state.stats()``
reports each bucket's choice and predicted and measured seconds (``auto_b<index>_...``) and
:meth:`AutoPolicy.report` the same as readable rows with the reason of the last decision.

The default candidate is :func:`commpress.ddp.candidate.default_candidate`'s (why: that module).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .. import comm
from ..codecs import Codec
from ..comm import CommStats, Hierarchical, callbacks
from ..comm.costmodel import (
    OPTIONS,
    DeviceCost,
    Entry,
    Link,
    NodeLinks,
    best,
    calibrate_cast,
    calibrate_compressed,
    calibrate_device,
    calibrate_link,
    compressed_plan,
    max_over_ranks,
    predict,
    predict_hierarchical,
    share_entries,
)
from ..comm.faults import wait
from ..errors import CodecError
from .candidate import SAFE_CANDIDATE, default_candidate
from .planning import BucketPlan

logger = logging.getLogger("commpress")

DEFAULT_INTERVAL = 100
DEFAULT_MARGIN = 0.1
#: Options of ``codec="auto"`` (everything else goes to the candidate codec or the state).
AUTO_OPTIONS = ("auto_codec", "auto_interval", "auto_margin", "auto_link", "auto_device")


@dataclass(frozen=True)
class AutoInputs:
    """What :class:`AutoPolicy` reads of the hook's state: its codec and group, and how it compresses.

    ``flush(plan, buffer)`` adds a bucket's residuals into a dense step's gradients and zeroes
    them (``CompressionState.flush_residuals``); ``counters`` are the collectives' counters.
    ``hierarchy``: the bound hierarchical algorithm the compressed option runs on several nodes
    (its node groups connected before calibration), else None.
    """

    codec: Codec
    algorithm: str
    world_size: int
    group: Any
    feedback: bool
    masking: bool
    momentum: bool
    counters: CommStats
    flush: Callable[[BucketPlan, torch.Tensor], None]
    hierarchy: Hierarchical | None = None


@dataclass
class BucketChoice:
    """One bucket's decision: its sizes, predicted and measured seconds per option, the choice."""

    index: int
    entries: tuple[Entry, ...]
    predicted: dict[str, float]
    option: str
    reason: str
    measured: dict[str, float] = field(default_factory=dict)  # mean of the last interval it ran in
    dtype: torch.dtype = torch.float32
    compressed_numel: int = 0
    decodes: float = 1.0  # packets each compressed element is decoded from (costmodel.compressed_plan)
    switches: int = 0
    needs_flush: bool = True  # residuals may be non-zero (a checkpoint, or compressed steps)
    _sums: dict[str, list[float]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, option: str, seconds: float) -> None:
        """Record one measured reduction (called from the collective's callback thread)."""
        with self._lock:
            acc = self._sums.setdefault(option, [0.0, 0.0])
            acc[0] += seconds
            acc[1] += 1

    def running(self) -> dict[str, float]:
        """Mean seconds per option over the current interval so far (not reset)."""
        with self._lock:
            return {o: v[0] / v[1] for o, v in self._sums.items() if v[1]}

    def take_means(self) -> list[float]:
        """Mean seconds per option over the interval (0: not run); start a new interval."""
        with self._lock:
            sums, self._sums = self._sums, {}
        return [sums[o][0] / sums[o][1] if o in sums else 0.0 for o in OPTIONS]


class AutoPolicy:
    """The per-bucket choice of ``codec="auto"`` (see the module docstring); one per state.

    Args:
        interval: re-decide every ``interval`` steps from measured times.
        margin: switch only to an option estimated faster by at least this fraction.
        link: a :class:`~commpress.comm.costmodel.Link` to use instead of calibrating the link
            (a known network, or tests forcing a slow link); the fp16 and compressed paths are
            then not timed on the group either (their excess over the link needs the real one).
        device: a :class:`~commpress.comm.costmodel.DeviceCost` instead of timing the codec.
    """

    def __init__(
        self,
        *,
        interval: int = DEFAULT_INTERVAL,
        margin: float = DEFAULT_MARGIN,
        link: Link | None = None,
        device: DeviceCost | None = None,
    ) -> None:
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise CodecError(f"auto_interval must be an int >= 1, got {interval!r}")
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise CodecError(f"auto_margin must be a number in [0, 1), got {margin!r}")
        if link is not None and not isinstance(link, Link):
            raise CodecError(f"auto_link must be a commpress.comm.costmodel.Link, got {link!r}")
        if device is not None and not isinstance(device, DeviceCost):
            raise CodecError(f"auto_device must be a commpress.comm.costmodel.DeviceCost, got {device!r}")
        self.interval = interval
        self.margin = float(margin)
        self._given = (link, device)
        self.link = link
        self.links: NodeLinks | None = None  # several nodes: the three links (flat is self.link)
        self.device_cost = device
        self.state: AutoInputs | None = None
        self.tensor_device: torch.device = torch.device("cpu")
        self.calibration_s = 0.0
        self._buckets: dict[int, BucketChoice] = {}  # id(BucketPlan) -> choice
        self._by_index: dict[int, BucketChoice] = {}  # DDP bucket index -> its latest choice
        self._used: dict[int, BucketChoice] = {}  # since the last decision
        self._this_step: dict[int, BucketChoice] = {}  # DDP bucket index -> choice, this step so far
        self._last_step: dict[int, BucketChoice] = {}  # the same, of the last step that consulted the policy
        self._work_predicted = 0.0  # predicted encode+decode seconds of the compressed runs since then
        self._work_seen = -1.0  # the counters' encode_s + decode_s at the last decision (-1: not yet)
        self.device_scale = 1.0  # measured / calibrated encode+decode time, from the last decision

    @classmethod
    def from_options(
        cls, options: dict[str, Any], optimizer: torch.optim.Optimizer | None = None, momentum: float = 0.0,
        world_size: int = 2, hierarchical: bool = False,
    ) -> tuple[str, AutoPolicy]:
        """Pop the ``auto_*`` options from ``options``; return the candidate codec's name and a policy.

        Without ``auto_codec`` the candidate is :func:`default_candidate` of ``optimizer``,
        ``momentum``, ``world_size`` and ``hierarchical`` (what the state is given; on several
        nodes ``world_size`` is the nodes; its codec parameters are added to ``options``), or
        QSGD when codec parameters are given.
        """
        candidate = options.pop("auto_codec", None)
        if candidate is None:
            if any(key not in AUTO_OPTIONS for key in options):
                candidate, why = SAFE_CANDIDATE, "codec parameters without auto_codec are QSGD's"
            else:
                candidate, params, why = default_candidate(optimizer, momentum, world_size, hierarchical)
                options.update(params)
            logger.info("commpress auto: candidate %s (%s)", candidate, why)
        if not isinstance(candidate, str) or candidate in ("auto", "none", "fp16", "bf16"):
            raise CodecError(f"auto_codec must name a compressing codec (topk, sign, qsgd, ...), got {candidate!r}")
        policy = cls(
            interval=options.pop("auto_interval", DEFAULT_INTERVAL),
            margin=options.pop("auto_margin", DEFAULT_MARGIN),
            link=options.pop("auto_link", None),
            device=options.pop("auto_device", None),
        )
        return candidate, policy

    def bind(self, state: AutoInputs, device: torch.device) -> AutoPolicy:
        """Attach to one hook state's :class:`AutoInputs` (once); ``device`` is where the model's gradients live."""
        if self.state is not None:
            raise CodecError("an AutoPolicy serves one CompressionState")
        self.state = state
        self.tensor_device = device
        return self

    def _state(self) -> AutoInputs:
        if self.state is None:
            raise CodecError("AutoPolicy is not bound to a CompressionState")
        return self.state

    def config(self) -> dict[str, Any]:
        """What all ranks must agree on (plain types)."""
        link, device = self._given
        return {
            "interval": self.interval, "margin": self.margin,
            "link": None if link is None else [link.alpha, link.beta],
            "device": None if device is None else [device.encode_s, device.decode_s, device.pass_s,
                                                   device.cast_s, device.mask_s, device.momentum_s],
        }

    # ----- calibration ----------------------------------------------------------------------
    @property
    def calibrated(self) -> bool:
        """True once link and device costs are known (on several nodes: all three links)."""
        nodes_known = self.state is None or self.state.hierarchy is None or self.links is not None
        return self.link is not None and self.device_cost is not None and nodes_known

    def _calibrate_nodes(self, h: Hierarchical) -> NodeLinks:
        """The node's and the cross-node links, each timed on its own groups at once, MAX over every rank.

        Every node times its own node group while the others do, and every local rank its
        cross-node group while the other local ranks do: as the hierarchical path runs, its ``L``
        shares crossing the network together. A given ``auto_link`` is the cross-node link.
        """
        state = self._state()
        assert self.link is not None
        if h.groups is None:
            h.connect(state.group)
        assert h.groups is not None
        intra = calibrate_link(h.groups.intra, self.tensor_device)
        inter = self._given[0] or calibrate_link(h.groups.inter, self.tensor_device)
        a = max_over_ranks([intra.alpha, intra.beta, inter.alpha, inter.beta], state.group, self.tensor_device)
        return NodeLinks(self.link, Link(a[0], a[1]), Link(a[2], a[3]))

    @property
    def _algorithm(self) -> str:
        """The compressed option's algorithm: the state's, or across nodes the hierarchy's inner one."""
        state = self._state()
        return state.algorithm if state.hierarchy is None or state.hierarchy.inner is None else state.hierarchy.inner.name

    def calibrate(self) -> None:
        """Measure what was not given (collectives on the state's group: every rank calls this)."""
        state = self._state()
        t = time.perf_counter()
        if self.link is None:
            self.link = calibrate_link(state.group, self.tensor_device)
        if state.hierarchy is not None and self.links is None:
            self.links = self._calibrate_nodes(state.hierarchy)
        if self.device_cost is None:
            self.device_cost = calibrate_device(
                state.codec, feedback=state.feedback, masking=state.masking, momentum=state.momentum,
                device=self.tensor_device, group=state.group,
            )
            if state.world_size > 1 and self._given[0] is None:
                # the fp16 and compressed paths as they really run on this group, less the link's
                # time for their bytes (with a given link that time is not the group's: skipped)
                c = self.device_cost
                cast = calibrate_cast(self.link, state.group, self.tensor_device)
                path = state.hierarchy if state.hierarchy is not None else state.algorithm
                self.device_cost = calibrate_compressed(
                    state.codec, path, self.links or self.link, dataclasses.replace(c, cast_s=cast),
                    feedback=state.feedback, group=state.group, device=self.tensor_device,
                )
        self.calibration_s = time.perf_counter() - t
        logger.info("commpress auto: link alpha %.1f us, %.2f Gbit/s; %r encode %.2f ns/element, decode %.2f "
                    "(calibrated in %.2f s)", self.link.alpha * 1e6, self.link.gbit, state.codec,
                    self.device_cost.encode_s * 1e9, self.device_cost.decode_s * 1e9, self.calibration_s)
        if self.links is not None:
            logger.info("commpress auto: in the node %.2f Gbit/s, across nodes %.2f Gbit/s",
                        self.links.intra.gbit, self.links.inter.gbit)

    def set_link(self, link: Link) -> None:
        """Use ``link`` from now on (every bucket is predicted again; they may switch at the next decision).

        On several nodes it is the network's: the flat and the cross-node link (the node's stays).
        """
        if not isinstance(link, Link):
            raise CodecError(f"link must be a Link, got {link!r}")
        self.link = link
        if self.links is not None:
            self.links = NodeLinks(link, self.links.intra, link)
        for b in self._buckets.values():
            b.predicted = self._predict(b.entries, b.dtype)

    # ----- per bucket -------------------------------------------------------------------------
    def _predict(self, entries: tuple[Entry, ...], dtype: torch.dtype) -> dict[str, float]:
        state = self._state()
        if not self.calibrated:
            self.calibrate()  # verify=False: the first bucket, after the deferred check
        assert self.link is not None and self.device_cost is not None
        h = state.hierarchy
        if h is not None and h.topology is not None:
            assert self.links is not None
            out = predict_hierarchical(entries, h.topology.nodes, h.topology.local_world_size, self.links,
                                       self.device_cost, state.codec, self._algorithm, dtype)
        else:
            out = predict(entries, state.world_size, self.link, self.device_cost, state.codec, state.algorithm, dtype)
        if not any(e.compressed for e in entries):
            out.pop("compressed")  # nothing to compress: dense frames would only cost more
        return out

    def choose(self, plan: BucketPlan, index: int) -> str:
        """The option of this bucket now (decided from the prediction at its first call)."""
        b = self._buckets.get(id(plan))
        if b is None:
            entries = tuple(Entry(p.numel, p.compressed) for p in plan.params)
            dtype = plan.params[0].dtype if plan.params else torch.float32
            predicted = self._predict(entries, dtype)
            encoded, decodes = self._encoded(entries)
            b = BucketChoice(index, entries, predicted, "dense", "dense: no option predicted faster by the margin",
                             dtype=dtype, compressed_numel=encoded, decodes=decodes)
            self.decide(b, first=True)
            self._buckets[id(plan)] = b
        b.index = index
        self._by_index[index] = b
        self._this_step[index] = b
        self._used[id(plan)] = b
        return b.option

    def _encoded(self, entries: tuple[Entry, ...]) -> tuple[int, float]:
        """Elements this rank encodes when the bucket compresses, and the packets each is decoded from."""
        state = self._state()
        h = state.hierarchy
        if h is not None and h.topology is not None:  # the share only, among the nodes
            shares = share_entries(entries, h.topology.local_world_size, state.codec.block_alignment())
            plan = compressed_plan(shares, state.codec, self._algorithm, h.topology.nodes)
            return sum(e.numel for e in shares if e.compressed), plan["decodes"]
        plan = compressed_plan(entries, state.codec, state.algorithm, state.world_size)
        return sum(e.numel for e in entries if e.compressed), plan["decodes"]

    def reduce(self, plan: BucketPlan, buffer: torch.Tensor, option: str) -> torch.futures.Future[torch.Tensor]:
        """Reduce a bucket dense or as fp16, first flushing residuals left by compressed steps."""
        state = self._state()
        b = self._buckets[id(plan)]
        start = time.perf_counter()
        if b.needs_flush:
            state.flush(plan, buffer)
            b.needs_flush = False
        wire = torch.float16 if option == "fp16" else None
        fut = comm.allreduce_mean(buffer, group=state.group, wire_dtype=wire, stats=state.counters,
                                   persistent=True)
        return self.timed(plan, option, start, fut)

    def timed(
        self, plan: BucketPlan, option: str, start: float, fut: torch.futures.Future[torch.Tensor]
    ) -> torch.futures.Future[torch.Tensor]:
        """``fut``, recording the seconds from ``start`` until its average is in place."""
        b = self._buckets[id(plan)]
        if option == "compressed":
            b.needs_flush = True
            cost = self.device_cost
            if cost is not None:
                self._work_predicted += b.compressed_numel * (cost.encode_s + b.decodes * cost.decode_s)

        def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            value = f.value()
            b.add(option, time.perf_counter() - start)
            return value

        return callbacks.then(fut, done)

    # ----- periodic decision -------------------------------------------------------------------
    def end_step(self, step: int, device: torch.device | str) -> None:
        """After step ``step``'s last bucket: every ``interval`` steps, re-decide (all ranks)."""
        if self._this_step:
            self._last_step, self._this_step = self._this_step, {}
        if (step + 1) % self.interval or not self._used:
            return
        used = sorted(self._used.values(), key=lambda b: b.index)
        self._used = {}
        state = self._state()
        counters = state.counters.as_dict()
        work = counters["encode_s"] + counters["decode_s"]
        spent = work - self._work_seen if 0 <= self._work_seen <= work else 0.0  # reset_stats: skip
        self._work_seen = work
        values = [m for b in used for m in b.take_means()] + [spent, self._work_predicted]
        self._work_predicted = 0.0
        sums = torch.tensor(values, dtype=torch.float64, device=device)
        if state.world_size > 1:
            wait(dist.all_reduce(sums, op=dist.ReduceOp.MAX, group=state.group, async_op=True), device)
        reduced = sums.tolist()
        spent_max, predicted_work = reduced[-2], reduced[-1]
        if spent_max > 0 and predicted_work > 0 and self.device_cost is not None:
            self.rescale_device(spent_max / predicted_work)
        for i, b in enumerate(used):
            for o, v in zip(OPTIONS, reduced[i * len(OPTIONS) : (i + 1) * len(OPTIONS)]):
                if v > 0:
                    b.measured[o] = v
        for b in self._buckets.values():
            self.decide(b)

    def all_exact(self) -> bool:
        """True when the last step's buckets all reduce dense or fp16 and hold no residual.

        Nothing is compressed then, so SGD momentum needs no correction in the hook and goes back
        to the optimizer (:meth:`CompressionState.place_momentum`). The same on every rank.
        """
        return bool(self._last_step) and all(
            b.option != "compressed" and not b.needs_flush for b in self._last_step.values()
        )

    def rescale_device(self, factor: float) -> None:
        """Multiply the device costs' encode and decode by ``factor`` (measured / predicted); re-predict."""
        if self.device_cost is None or not factor > 0 or not math.isfinite(factor):
            return
        c = self.device_cost
        self.device_cost = dataclasses.replace(c, encode_s=c.encode_s * factor, decode_s=c.decode_s * factor)
        self.device_scale *= factor
        for b in self._buckets.values():
            b.predicted = self._predict(b.entries, b.dtype)

    def decide(self, b: BucketChoice, first: bool = False) -> bool:
        """Switch ``b`` when another option is predicted faster by its margin; True if it switched.

        The margin is ``auto_margin`` doubled for every switch the bucket made (at most 50%).
        ``first``: the bucket's first decision, from dense (exact, and what the model knows best:
        every other option adds CPU work that it predicts less well), not counted as a switch.
        """
        cand = best(b.predicted)
        cur = b.option
        margin = min(0.5, self.margin * 2**b.switches)
        if cand == cur or b.predicted[cand] >= b.predicted[cur] * (1.0 - margin):
            return False
        b.reason = (f"{cand} (predicted {b.predicted[cand] * 1e3:.2f} ms) beat {cur} (predicted "
                    f"{b.predicted[cur] * 1e3:.2f} ms) by more than the {margin:.0%} margin"
                    + (" at the first step" if first else ""))
        b.option = cand
        if first:
            return True
        b.switches += 1
        logger.info("commpress auto: bucket %d -> %s", b.index, b.reason)
        return True

    # ----- reporting ---------------------------------------------------------------------------
    def report(self) -> list[dict[str, Any]]:
        """One row per current DDP bucket: index, elements, option, predicted/measured seconds, reason.

        ``measured_s``: this rank's mean per option over the current interval where it ran in
        it, else the last decision's (MAX over ranks).
        """
        return [
            {"bucket": i, "numel": sum(e.numel for e in b.entries), "option": b.option,
             "predicted_s": dict(b.predicted), "measured_s": {**b.measured, **b.running()}, "switches": b.switches,
             "reason": b.reason}
            for i, b in sorted(self._by_index.items())
        ]

    def stats(self) -> dict[str, float]:
        """Flat numbers for ``CompressionState.stats()`` (``auto_b<index>_choice`` indexes :data:`OPTIONS`)."""
        s: dict[str, float] = {"auto_calibration_s": self.calibration_s}
        if self.link is not None:
            s["auto_link_alpha_s"] = self.link.alpha
            s["auto_link_gbit"] = self.link.gbit if math.isfinite(self.link.gbit) else 0.0
        if self.links is not None:
            for level in ("intra", "inter"):
                link = getattr(self.links, level)
                s[f"auto_{level}_alpha_s"] = link.alpha
                s[f"auto_{level}_gbit"] = link.gbit if math.isfinite(link.gbit) else 0.0
        if self.device_cost is not None:
            s["auto_encode_ns"] = self.device_cost.encode_s * 1e9
            s["auto_decode_ns"] = self.device_cost.decode_s * 1e9
            s["auto_momentum_ns"] = self.device_cost.momentum_s * 1e9
            s["auto_device_scale"] = self.device_scale
        for o in OPTIONS:
            s[f"auto_{o}_buckets"] = sum(b.option == o for b in self._by_index.values())
        s["auto_switches"] = sum(b.switches for b in self._buckets.values())
        for i, b in sorted(self._by_index.items()):
            s[f"auto_b{i}_choice"] = OPTIONS.index(b.option)
            for o, v in b.predicted.items():
                s[f"auto_b{i}_{o}_predicted_s"] = v
            for o, v in b.measured.items():
                s[f"auto_b{i}_{o}_measured_s"] = v
        return s


__all__ = ["AUTO_OPTIONS", "AutoInputs", "AutoPolicy", "BucketChoice"]
