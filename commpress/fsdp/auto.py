"""``codec="auto"`` on FSDP2: per module, its reduce-scatter and its parameter all-gather each exact, bf16 or compressed.

``commpress.fsdp.register(model, "auto")`` chooses, for every FSDP module and for each of its two
collectives, the option with the least predicted time (:data:`~commpress.comm.costmodel.SHARDED_OPTIONS`):

=============  ================================================  ==========================================
option         gradient reduce-scatter                           parameter all-gathers (forward, backward)
=============  ================================================  ==========================================
``dense``      FSDP's own (``none``: FSDP bit for bit)           FSDP's own (``param_codec="none"``)
``bf16``       a bf16 cast through the all_to_all                a bf16 cast, both directions
``compressed`` 2-bit QSGD (unbiased, no residuals)               int8 forward, backward reuses its frames
=============  ================================================  ==========================================

The compressed options are the recommended setting's codecs (``docs/fsdp.md``). How:

1. **Calibrate** at registration, after the configuration check, every rank together: the
   link's ``alpha``/``beta`` from timed all-reduces (:func:`~commpress.comm.costmodel.calibrate_link`,
   unless ``auto_link=`` gives one), the per-element costs of the bf16 cast, 2-bit QSGD and
   int8 on this device (:func:`~commpress.comm.costmodel.calibrate_codecs`), and each option's
   fixed cost per call beyond the exact path's, from its real reduce-scatter and all-gather run
   on a small synthetic module (:func:`~commpress.comm.costmodel.path_overhead`). Every number
   is all-reduced with MAX, so every rank holds the same ones.
2. **Predict** each module's collectives from its sizes (padded shard, quantised elements, the
   frames' bytes, the dtypes FSDP reduces and gathers in, how many all-gathers a step makes:
   :func:`~commpress.comm.costmodel.predict_reduce_scatter`,
   :func:`~commpress.comm.costmodel.predict_all_gather`), and take the least (ties: the more
   exact option). Pure arithmetic on equal numbers: every rank chooses the same, and the
   configuration check that follows (the choices are part of ``config()``) says so or fails
   every rank.
3. **Fall back**: a calibration that fails on any rank (an exception, a non-finite time) makes
   every module exact on every rank, with a log line saying why.

**Optimizer modes.** Both compressed candidates are unbiased or exact and keep no residuals,
so the user's optimizer runs unchanged under every option (no momentum moves into the
reduce-scatter, nothing to flush when a module changes option): bf16 on the wire composes with
any optimizer because nothing else is engaged. Error feedback (``error_feedback=True``) and a
biased candidate are refused with ``codec="auto"``: they would need the optimizer modes per
module, which this does not build.

**Sharded inside the node** (HSDP: :func:`commpress.fsdp.node_mesh`): the parameter all-gather
and the gradient reduce-scatter run inside the node on FSDP's own fast collectives, and what auto
chooses per module is the all-reduce of the node's shard across nodes: ``dense`` (an fp32
all-reduce), ``bf16`` (a cast all-reduce) or ``compressed`` (2-bit QSGD: all-gather at 2 nodes,
two-phase from 3). Its link is calibrated on the cross-node group (every local rank at once, as
the step runs them), MAX over every rank; the fixed cost per call is timed on the same paths
(:meth:`FSDPAuto._time_cross_paths`) and the module predicted by
:func:`~commpress.comm.costmodel.predict` over ``nodes`` ranks.

The choices are part of the state (``state_dict()``, ``dcp()``): a resumed run takes the
saved ones, whatever its own calibration said. ``stats()`` has ``auto_<module>_reduce_scatter``
/ ``auto_<module>_all_gather`` (an index into ``SHARDED_OPTIONS``) and the predicted seconds
of every option; :meth:`FSDPAuto.report` the same as rows.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.fsdp import FSDPModule

from .. import codecs, comm
from ..codecs import Codec, NoneCodec
from ..comm import CommStats, Slot, piece_key
from ..comm.costmodel import (
    SHARDED_OPTIONS,
    DeviceCost,
    Entry,
    Link,
    best,
    calibrate_codecs,
    calibrate_link,
    check_calibration_numel,
    check_link,
    exact_options,
    max_over_ranks,
    path_overhead,
    predict,
    predict_all_gather,
    predict_reduce_scatter,
    time_over_ranks,
)
from ..errors import CodecError
from .allgather import DEFAULT, AllGatherPlan, frame_layout

if TYPE_CHECKING:
    from .state import FSDPCompressionState

logger = logging.getLogger("commpress")

#: Options of ``codec="auto"`` on FSDP (everything else goes to the state).
AUTO_OPTIONS = ("auto_link", "auto_calibration_numel")
#: The compressed reduce-scatter's codec: the recommended setting's 2-bit QSGD.
GRAD_CODEC: tuple[str, dict[str, Any]] = ("qsgd", {"bits": 2})
#: The compressed all-gather's codec (forward; the backward reuses its frames).
PARAM_CODEC = "int8"
#: Elements each codec is timed on (4 MB of float32: ~0.1 s for the three codecs on one CPU core).
CALIBRATION_NUMEL = 1 << 20
#: The two collectives a module chooses for.
COLLECTIVES = ("reduce_scatter", "all_gather")
#: Elements per parameter of the synthetic module whose collectives are timed for each option's
#: fixed cost per call (small: the wire hardly matters; as many parameters as the largest module, at most 16).
OVERHEAD_NUMEL = 64
OVERHEAD_MAX_PARAMS = 16


@dataclass
class ModuleChoice:
    """One FSDP module's choice: per collective, the option and every option's predicted seconds."""

    name: str
    reduce_scatter: str = "dense"
    all_gather: str = "dense"
    predicted: dict[str, dict[str, float]] = field(default_factory=lambda: {c: {} for c in COLLECTIVES})


def _fsdp_dtypes(param_group: Any) -> tuple[torch.dtype, torch.dtype]:
    """(all-gather dtype, reduce-scatter dtype) of an FSDP parameter group (MixedPrecisionPolicy's, else the parameters')."""
    fp = param_group.fsdp_params[0]
    orig = getattr(fp, "orig_dtype", fp.sharded_param.dtype)
    gather = getattr(fp, "param_dtype", None) or orig
    reduce = getattr(fp, "reduce_dtype", None) or gather
    return gather, reduce


def _gathers_per_step(module: Any, root: torch.nn.Module, param_group: Any) -> int:
    """2 when FSDP reshards the module after forward (the backward all-gathers again), else 1.

    FSDP resets the root's resharding to False at its lazy init (after ``register``) unless the
    user set it: the root then counts one all-gather.
    """
    if not param_group._reshard_after_forward:
        return 1
    if module is root and getattr(module._get_fsdp_state(), "_auto_reshard_after_forward", False):  # type: ignore[operator]
        return 1
    return 2


class FSDPAuto:
    """The per-module choice of ``codec="auto"`` on FSDP2 (see the module docstring); one per state.

    Args:
        link: a :class:`~commpress.comm.costmodel.Link` to predict with instead of calibrating
            the link (a known network, or tests forcing a slow or fast one:
            ``auto_link=Link.from_gbit(0.1)``); the device costs are still measured.
        calibration_numel: elements each codec is timed on.
    """

    def __init__(self, *, link: Link | None = None, calibration_numel: int = CALIBRATION_NUMEL) -> None:
        self._given = check_link(link)
        self.calibration_numel = check_calibration_numel(calibration_numel)
        self.link: Link | None = link
        self.costs: dict[str, DeviceCost] | None = None
        self.choices: dict[str, ModuleChoice] = {}
        #: per collective and option, its path's fixed seconds per call beyond the exact one's (measured)
        self.overhead: dict[str, dict[str, float]] = {c: {} for c in COLLECTIVES}
        self.calibration_s = 0.0
        self.fallback = ""  # why every module is exact, when the calibration failed
        self.loaded = False  # the choices came from a checkpoint
        self.grad_codec: Codec = codecs.get(GRAD_CODEC[0], **GRAD_CODEC[1])
        self.param_codec: Codec = codecs.get(PARAM_CODEC)
        self.bf16: Codec = codecs.get("bf16")
        self.none: Codec = codecs.get("none")

    @classmethod
    def from_options(cls, codec_params: dict[str, Any], *, param_codec: Any = DEFAULT, error_feedback: Any = None,
                     warmup_codec: Any = None, warmup_steps: Any = None) -> FSDPAuto:
        """The policy from ``register``'s ``auto_*`` options (popped from ``codec_params``); refuse the rest.

        ``codec="auto"`` takes no codec parameters (its candidates are fixed), no ``param_codec=``
        (it chooses the all-gathers; any value given, ``None`` and ``"none"`` included, is refused), no ``error_feedback=True`` and no ``warmup_codec=`` or
        ``warmup_steps`` above 0 (its candidates keep no residuals): each raises a
        :class:`CodecError` naming it.
        """
        link = codec_params.pop("auto_link", None)
        numel = codec_params.pop("auto_calibration_numel", CALIBRATION_NUMEL)
        for key, given, why in (("param_codec", param_codec is not DEFAULT, "it chooses each module's parameter all-gather itself"),
                                ("warmup_codec", warmup_codec is not None, "its candidates keep no residuals and need no warm-up")):
            if given:
                raise CodecError(f"codec='auto' takes no {key}= ({why}); drop {key}= or name a codec")
        if warmup_steps:
            raise CodecError(f"codec='auto' takes no warmup_steps={warmup_steps!r}: its candidates keep no residuals and "
                             "need no warm-up (a module compresses from its first step or not at all)")
        if error_feedback:
            raise CodecError("codec='auto' takes no error_feedback=True: its candidates (bf16, 2-bit QSGD, int8) keep no "
                             "residuals, and a biased codec would need the optimizer modes per module")
        if codec_params:
            raise CodecError(f"codec='auto' takes no codec parameters ({', '.join(sorted(codec_params))}): its "
                             f"candidates are fixed ({GRAD_CODEC[0]} bits={GRAD_CODEC[1]['bits']}, {PARAM_CODEC}); "
                             f"its options are {', '.join(AUTO_OPTIONS)}")
        return cls(link=link, calibration_numel=numel)

    def config(self) -> dict[str, Any]:
        """What all ranks must agree on (plain types): the options and, once made, the choices."""
        link = self._given
        return {
            "link": None if link is None else [link.alpha, link.beta],
            "calibration_numel": self.calibration_numel,
            "choices": {m: [c.reduce_scatter, c.all_gather] for m, c in sorted(self.choices.items())},
        }

    # ----- calibration and choice ----------------------------------------------------------
    def choose(self, state: FSDPCompressionState, model: torch.nn.Module) -> None:
        """Calibrate (a collective on the state's group: every rank calls it) and choose per module."""
        t0 = time.perf_counter()
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
        group = state._group
        self.fallback = ""
        failed = ""
        across = state.topology.hierarchical  # HSDP: choose the cross-node all-reduce of each shard
        try:
            if self.link is None:
                self.link = calibrate_link(state._inter_group if across else group, device)
        except Exception as exc:  # noqa: BLE001 - fall back to exact, say why (on every rank: below)
            failed = f"link calibration failed ({type(exc).__name__}: {exc})"
        if across:  # each cross-node group measured its own link: every rank takes the slowest
            link = self.link or Link(0.0, 0.0)
            alpha, beta, bad = max_over_ranks([link.alpha, link.beta, 1.0 if failed else 0.0], group, device)
            failed = failed or ("link calibration failed on a peer rank" if bad else "")
            self.link = Link(alpha, beta) if not failed else self.link
        # every rank enters this all-reduce, a rank whose link calibration failed too (its flag)
        self.costs, why = calibrate_codecs(
            {"bf16": self.bf16, "compressed": self.grad_codec, "int8": self.param_codec},
            group=group, device=device, numel=self.calibration_numel, failed=failed,
        )
        if self.costs is None:
            self.fallback = f"calibration failed ({why})"
        if not self.fallback:
            why = self._time_cross_paths(state, device) if across else self._time_paths(state, device)
            if why:
                self.fallback = f"timing the collectives failed ({why})"
        self.calibration_s = time.perf_counter() - t0
        if self.fallback:
            logger.warning("commpress auto (FSDP): %s; every module stays exact (FSDP's own collectives)", self.fallback)
            self.choices = {m.name: ModuleChoice(m.name) for m in state.modules}
            return
        predict_one = self._predict_across if across else self._predict
        self.choices = {m.name: predict_one(state, model, m.name) for m in state.modules}
        assert self.link is not None
        logger.info("commpress auto (FSDP): link %.2f Gbit/s, alpha %.1f us; %s (calibrated in %.2f s)",
                    self.link.gbit, self.link.alpha * 1e6,
                    ", ".join(f"{c.name}: {c.reduce_scatter}/{c.all_gather}" for c in self.choices.values()),
                    self.calibration_s)

    def _time_paths(self, state: FSDPCompressionState, device: torch.device) -> str:
        """Time every option's real reduce-scatter and all-gather on a small synthetic module (a collective).

        Sets :attr:`overhead` (:func:`~commpress.comm.costmodel.path_overhead`: each option's fixed
        cost per call beyond the exact path's, which per-element codec costs miss); returns why not.
        """
        assert self.link is not None and self.costs is not None
        n, group, k = state.world_size, state._group, OVERHEAD_NUMEL
        params = min(max(len(m.params) for m in state.modules), OVERHEAD_MAX_PARAMS)
        chunk = params * k
        gen = torch.Generator().manual_seed(3)
        flat = torch.randn(n * chunk, generator=gen).to(device)
        out = torch.empty(chunk, device=device)
        counters = CommStats()  # not the state's: calibration traffic is not training traffic
        rs_codecs = {"bf16": self.bf16, "compressed": self.grad_codec}

        def reduce_scatter(codec: Codec) -> Any:
            if isinstance(codec, NoneCodec):
                slots = [Slot(f"auto calibration#{j}", j * chunk, (chunk,), codec) for j in range(n)]
                algorithm = "reducescatter-dense"
            else:
                slots = [Slot(piece_key(f"auto calibration {p}", j), j * chunk + p * k, (k,), codec, p)
                         for j in range(n) for p in range(params)]
                algorithm = "reducescatter"
            return lambda: comm.run(algorithm, flat, slots, group=group, stats=counters, output=out).wait()

        fns = [reduce_scatter(c) for c in (self.none, *rs_codecs.values())]
        entries = [Entry(k, True)] * params
        predicted_rs = predict_reduce_scatter(entries, n, self.link, {o: self.costs[o] for o in rs_codecs}, rs_codecs)
        ag_codecs = {"bf16": self.bf16, "compressed": self.param_codec}
        plan = AllGatherPlan("auto calibration", [f"w{p}" for p in range(params)], [k] * params, [True] * params, n)
        shard = torch.randn(chunk, generator=gen).to(device)
        gathered = torch.empty(n * chunk, device=device)
        ag = state.allgather

        def all_gather(codec: Codec) -> Any:
            def once() -> None:
                assert ag is not None
                plan.codecs, plan.reuse, plan.layouts = dict.fromkeys(("forward", "backward"), codec), False, {}
                ag.gather(plan, gathered, shard, group)
            return once

        if ag is not None:
            fns += [all_gather(c) for c in (self.none, *ag_codecs.values())]
        measured, why = time_over_ranks(fns, group=group, device=device)
        if ag is not None:
            ag.reset_stats()  # calibration traffic is not training traffic
        if measured is None:
            return why
        self.overhead["reduce_scatter"] = path_overhead(dict(zip(SHARDED_OPTIONS, measured[:3])), predicted_rs)
        if ag is not None:
            frames = {o: (frame_layout(plan, c, torch.float32).nbytes, self.costs["int8" if o == "compressed" else o])
                      for o, c in ag_codecs.items()}
            predicted_ag = predict_all_gather(chunk, chunk, n, self.link, dense_bytes=4 * chunk, frames=frames, gathers=1)
            self.overhead["all_gather"] = path_overhead(dict(zip(SHARDED_OPTIONS, measured[3:])), predicted_ag)
        return ""

    def _cross_options(self, state: FSDPCompressionState, entries: list[Entry], dtype: torch.dtype) -> dict[str, float]:
        """Predicted seconds of one shard's all-reduce across the nodes, per option (before fixed costs)."""
        assert self.link is not None and self.costs is not None
        nodes = state.topology.nodes
        numel = sum(e.numel for e in entries)
        out = {"dense": exact_options(numel, nodes, self.link, self.costs["bf16"], dtype)["dense"]}
        if dtype in (torch.float32, torch.float64):
            out["bf16"] = predict(entries, nodes, self.link, self.costs["bf16"], self.bf16, "allreduce", dtype)["compressed"]
        if any(e.compressed for e in entries):
            algorithm = state._cross_algorithm(self.grad_codec, ())  # what reduce() runs: its candidate keeps no residuals
            out["compressed"] = predict(entries, nodes, self.link, self.costs["compressed"], self.grad_codec, algorithm,
                                        dtype)["compressed"]
        return out

    def _time_cross_paths(self, state: FSDPCompressionState, device: torch.device) -> str:
        """Time each option's real cross-node all-reduce of a small synthetic shard (a collective); set :attr:`overhead`."""
        assert self.link is not None and self.costs is not None
        k = OVERHEAD_NUMEL
        params = min(max(len(m.params) for m in state.modules), OVERHEAD_MAX_PARAMS)
        flat = torch.randn(params * k, generator=torch.Generator().manual_seed(3)).to(device)
        buf = torch.empty_like(flat)
        counters = CommStats()  # not the state's: calibration traffic is not training traffic

        def cross(codec: Codec) -> Any:
            slots = [Slot(f"auto calibration {p}#0", p * k, (k,), codec, p) for p in range(params)]
            algorithm = state._cross_algorithm(codec, slots)

            def once() -> None:
                buf.copy_(flat)
                comm.run(algorithm, buf, slots, group=state._inter_group, stats=counters).wait()
            return once

        measured, why = time_over_ranks([cross(c) for c in (self.none, self.bf16, self.grad_codec)], group=state._group,
                                        device=device)
        if measured is None:
            return why
        predicted = self._cross_options(state, [Entry(k, True)] * params, torch.float32)
        self.overhead["reduce_scatter"] = path_overhead(dict(zip(SHARDED_OPTIONS, measured)), predicted)
        return ""

    def _predict_across(self, state: FSDPCompressionState, model: torch.nn.Module, name: str) -> ModuleChoice:
        """A module's choice sharded inside the node: its shard's all-reduce across nodes (FSDP gathers in the node)."""
        plan = next(m for m in state.modules if m.name == name)
        modules: dict[str, Any] = {k or "<root>": v for k, v in model.named_modules() if isinstance(v, FSDPModule)}
        _, reduce_dtype = _fsdp_dtypes(modules[name]._get_fsdp_state()._fsdp_param_groups[0])
        predicted = self._cross_options(state, [Entry(p.chunk_numel, p.compressed) for p in plan.params], reduce_dtype)
        predicted = {o: t + self.overhead["reduce_scatter"].get(o, 0.0) for o, t in predicted.items()}
        choice = ModuleChoice(name)
        choice.predicted["reduce_scatter"] = predicted
        choice.reduce_scatter = best(predicted, SHARDED_OPTIONS)
        return choice

    def _predict(self, state: FSDPCompressionState, model: torch.nn.Module, name: str) -> ModuleChoice:
        assert self.link is not None and self.costs is not None
        n = state.world_size
        plan = next(m for m in state.modules if m.name == name)
        modules: dict[str, Any] = {k or "<root>": v for k, v in model.named_modules() if isinstance(v, FSDPModule)}
        group = modules[name]._get_fsdp_state()._fsdp_param_groups[0]
        gather_dtype, reduce_dtype = _fsdp_dtypes(group)
        choice = ModuleChoice(name)
        entries = [Entry(p.chunk_numel, p.compressed) for p in plan.params]
        wide = (torch.float32, torch.float64)
        rs_codecs = {o: c for o, c in (("bf16", self.bf16), ("compressed", self.grad_codec))
                     if (o != "bf16" or reduce_dtype in wide) and (o != "compressed" or any(e.compressed for e in entries))}
        predicted = predict_reduce_scatter(entries, n, self.link, {o: self.costs[o] for o in ("bf16", "compressed")},
                                           rs_codecs, reduce_dtype)
        predicted = {o: t + self.overhead["reduce_scatter"].get(o, 0.0) for o, t in predicted.items()}
        choice.predicted["reduce_scatter"] = predicted
        choice.reduce_scatter = best(predicted, SHARDED_OPTIONS)
        ag = state.allgather.plans.get(name) if state.allgather is not None else None
        if ag is not None:
            gathers = _gathers_per_step(modules[name], model, group)
            nc = sum(k for k, c in zip(ag.numels, ag.compressed) if c)
            frames: dict[str, tuple[int, DeviceCost]] = {}
            if gather_dtype in wide:
                frames["bf16"] = (frame_layout(ag, self.bf16, gather_dtype).nbytes, self.costs["bf16"])
            if nc:
                frames["compressed"] = (frame_layout(ag, self.param_codec, gather_dtype).nbytes, self.costs["int8"])
            size = torch.empty((), dtype=gather_dtype).element_size()
            predicted = predict_all_gather(ag.shard_numel, nc, n, self.link, dense_bytes=ag.shard_numel * size,
                                           frames=frames, gathers=gathers, reuse=("compressed",) if gathers == 2 else ())
            predicted = {o: t + gathers * self.overhead["all_gather"].get(o, 0.0) for o, t in predicted.items()}
            choice.predicted["all_gather"] = predicted
            choice.all_gather = best(predicted, SHARDED_OPTIONS)
        return choice

    # ----- applying the choices ------------------------------------------------------------
    def reduce_codec(self, name: str) -> Codec:
        """The reduce-scatter codec of module ``name`` (``none``: FSDP's own)."""
        option = self.choices[name].reduce_scatter if name in self.choices else "dense"
        return {"dense": self.none, "bf16": self.bf16, "compressed": self.grad_codec}[option]

    def gather_codecs(self, name: str) -> tuple[dict[str, Codec], bool]:
        """The all-gather codecs by direction and the reuse flag of module ``name``."""
        option = self.choices[name].all_gather if name in self.choices else "dense"
        if option == "compressed":
            return dict.fromkeys(("forward", "backward"), self.param_codec), True
        codec = self.bf16 if option == "bf16" else self.none
        return dict.fromkeys(("forward", "backward"), codec), False

    # ----- checkpoint form -----------------------------------------------------------------
    def state(self, modules: list[str]) -> list[int]:
        """The choices as integers in ``modules`` order: ``3 * reduce_scatter + all_gather`` (option indexes)."""
        return [3 * SHARDED_OPTIONS.index(self.choices[m].reduce_scatter) + SHARDED_OPTIONS.index(self.choices[m].all_gather)
                for m in modules]

    def load(self, codes: Any, modules: list[str]) -> dict[str, ModuleChoice]:
        """Validate :meth:`state` output for ``modules``; return the choices (does not apply them)."""
        if not isinstance(codes, (list, tuple)) or len(codes) != len(modules) or not all(
                isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 9 for c in codes):
            raise ValueError(f"auto choices must be {len(modules)} ints in [0, 9) (one per FSDP module), got {codes!r}")
        out = {}
        for m, c in zip(modules, codes):
            old = self.choices.get(m)
            choice = ModuleChoice(m, SHARDED_OPTIONS[c // 3], SHARDED_OPTIONS[c % 3],
                                  old.predicted if old is not None else {k: {} for k in COLLECTIVES})
            out[m] = choice
        return out

    # ----- reporting -----------------------------------------------------------------------
    def report(self) -> list[dict[str, Any]]:
        """One row per FSDP module: its options and predicted seconds per collective."""
        return [{"module": c.name, "reduce_scatter": c.reduce_scatter, "all_gather": c.all_gather,
                 "predicted_s": {k: dict(v) for k, v in c.predicted.items()}} for c in self.choices.values()]

    def stats(self) -> dict[str, float]:
        """Flat numbers for ``FSDPCompressionState.stats()`` (choices index :data:`SHARDED_OPTIONS`)."""
        s: dict[str, float] = {"auto_calibration_s": self.calibration_s, "auto_fallback": float(bool(self.fallback)),
                               "auto_loaded": float(self.loaded)}
        if self.link is not None:
            s["auto_link_alpha_s"] = self.link.alpha
            s["auto_link_gbit"] = self.link.gbit if math.isfinite(self.link.gbit) else 0.0
        for collective, by_option in self.overhead.items():
            for o, v in by_option.items():
                s[f"auto_{collective}_{o}_call_s"] = v
        for kind, cost in (self.costs or {}).items():
            s[f"auto_{kind}_encode_ns"] = cost.encode_s * 1e9
            s[f"auto_{kind}_decode_ns"] = cost.decode_s * 1e9
        for collective in COLLECTIVES:
            for o in SHARDED_OPTIONS:
                s[f"auto_{collective}_{o}_modules"] = sum(getattr(c, collective) == o for c in self.choices.values())
        for c in self.choices.values():
            for collective in COLLECTIVES:
                s[f"auto_{c.name}_{collective}"] = SHARDED_OPTIONS.index(getattr(c, collective))
                for o, v in c.predicted.get(collective, {}).items():
                    s[f"auto_{c.name}_{collective}_{o}_predicted_s"] = v
        return s


def is_auto(codec: Any) -> bool:
    """True for ``codec="auto"``."""
    return isinstance(codec, str) and codec == "auto"


__all__ = ["AUTO_OPTIONS", "COLLECTIVES", "FSDPAuto", "GRAD_CODEC", "ModuleChoice", "PARAM_CODEC", "is_auto"]
