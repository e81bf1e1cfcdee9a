"""``DiLoCo(model, opt, codec="auto")``: the outer gradient's codec, chosen from the cost model.

**The rule.** Among :data:`CANDIDATES`, most exact first (dense ``"none"``, QSGD 8-bit, QSGD
4-bit, sign with error feedback), take the first whose predicted sync time fits in the overlap
window; when none fits, the last one (sign, the fewest bytes: ``DiLoCo``'s default codec since
2026-12-07, added here then). Before the choice the provisional codec is QSGD 4-bit
(:data:`PROVISIONAL`), which keeps no error-feedback residual, so a checkpoint taken before the
first sync holds none and the choice changes no other state (sign's residuals start at zero).

- **Predicted sync time** of a candidate: the largest fragment's reduction as
  :class:`~.outer.OuterReduction` would run it (its slots, compressed and dense parameters, its
  algorithm at this world size): the wire time of the algorithm's collectives over the link
  (:func:`~commpress.comm.costmodel.compressed_plan`, :func:`~commpress.comm.costmodel.wire_time`)
  plus encode, decodes and passes (:func:`~commpress.comm.costmodel.predict`'s compressed option).
- **Window**: ``overlap`` inner steps of compute; with ``overlap=0`` (a blocking sync)
  :data:`BLOCKING_FRACTION` (10%) of the ``sync_every / fragments`` steps between syncs, so a
  blocking sync costs at most about that much of the run.
- **Step compute**: the median interval between the inner steps before the first sync (the first
  step, with its warm-up, is left out when there are later ones), the least over the ranks (the
  shortest window is the one that must hold).
- **Calibration** at construction, every rank together: the link (``alpha``, ``beta``) from timed
  all-reduces (:func:`~commpress.comm.costmodel.calibrate_link`, unless ``auto_link=`` gives one),
  and the device costs of the compressing candidates (:func:`~commpress.comm.costmodel.calibrate_codecs`),
  each all-reduced with MAX. A device calibration that fails on any rank makes every rank take
  the last candidate (sign), with a log line saying why.

The choice is made at the first sync, before it launches (step ``sync_every / fragments``), on
numbers every rank holds alike, and checked (one all-reduce): every rank takes the same codec.
Until then the provisional codec is QSGD 4-bit; ``config()`` says ``outer_auto:
"undecided"``. The choice is part of the configuration, so it is saved in ``state_dict()`` and a
resumed run keeps it, whatever its own calibration says. Rank 0 logs the choice and the reason
(logger ``commpress``, INFO); ``stats()`` has ``auto_choice`` (an index into
:data:`CANDIDATES`, -1 before the decision), ``auto_window_s``, ``auto_step_s``, the link and
``auto_predicted_<candidate>_s``.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..comm.costmodel import (
    DeviceCost,
    Entry,
    Link,
    calibrate_codecs,
    calibrate_link,
    check_calibration_numel,
    check_link,
    max_over_ranks,
    predict,
)
from ..errors import ConfigurationError
from .outer import OuterReduction

logger = logging.getLogger("commpress")

#: The candidates, most exact first: (label, codec name, codec parameters).
CANDIDATES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("dense", "none", {}), ("qsgd8", "qsgd", {"bits": 8}), ("qsgd4", "qsgd", {"bits": 4}), ("sign", "sign", {}),
)
#: The candidate a DiLoCo reduces with until the choice (QSGD 4-bit: no residual to save before it)
PROVISIONAL = 2
#: With ``overlap=0`` the window is this fraction of the compute between two syncs.
BLOCKING_FRACTION = 0.1
#: Elements each QSGD codec is timed on at construction (4 MB of float32).
CALIBRATION_NUMEL = 1 << 20
#: Options of ``codec="auto"`` (every other codec parameter is refused: auto chooses them).
AUTO_OPTIONS = ("auto_link", "auto_calibration_numel")


class OuterAuto:
    """The outer codec choice of one DiLoCo (see the module docstring)."""

    def __init__(self, *, link: Link | None = None, calibration_numel: int = CALIBRATION_NUMEL) -> None:
        self.forced_link = check_link(link)
        self.calibration_numel = check_calibration_numel(calibration_numel)
        self.link: Link | None = None
        self.costs: dict[str, DeviceCost] | None = None
        self.failed = ""
        self.choice: int | None = None
        self.reason = ""
        self.window_s = math.nan
        self.step_s = math.nan
        self.predicted: dict[str, float] = {}
        self._ticks: list[float] = []

    @classmethod
    def from_params(cls, codec_params: dict[str, Any]) -> OuterAuto:
        """Take the ``auto_*`` options out of ``codec_params``; any other parameter is a ConfigurationError."""
        other = sorted(k for k in codec_params if k not in AUTO_OPTIONS)
        if other:
            raise ConfigurationError(f"codec='auto' chooses the outer codec and its parameters; got {other} "
                                     f"(it takes only {', '.join(AUTO_OPTIONS)})")
        return cls(link=codec_params.get("auto_link"),
                   calibration_numel=codec_params.get("auto_calibration_numel", CALIBRATION_NUMEL))

    @staticmethod
    def reductions(names: Sequence[str], shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, **kwargs: Any
                   ) -> list[OuterReduction]:
        """One :class:`OuterReduction` per candidate (``kwargs``: its keyword arguments)."""
        return [OuterReduction(names, shapes, dtype, codec, dict(params), **kwargs) for _, codec, params in CANDIDATES]

    @property
    def decided(self) -> bool:
        """True once a candidate is chosen (or loaded from a checkpoint)."""
        return self.choice is not None

    def calibrate(self, candidates: Sequence[OuterReduction], group: Any, device: torch.device) -> None:
        """Measure the link (unless forced) and the compressing candidates' device costs: a collective, MAX over ranks."""
        self.link = self.forced_link or calibrate_link(group, device)
        codecs = {label: red.codec for (label, codec, _), red in zip(CANDIDATES, candidates) if codec != "none"}
        self.costs, self.failed = calibrate_codecs(codecs, group=group, device=device, numel=self.calibration_numel)
        self._ticks = [time.perf_counter()]

    def note_step(self) -> None:
        """After an inner step before the decision: its end time (the step compute is measured from these)."""
        self._ticks.append(time.perf_counter())

    def measured_step_s(self) -> float:
        """The step compute on this rank: the median interval between the steps noted (the first left out when it can be)."""
        gaps = [b - a for a, b in zip(self._ticks, self._ticks[1:])]
        if len(gaps) > 1:
            gaps = gaps[1:]  # the first step holds the warm-up
        return statistics.median(gaps) if gaps else 0.0

    def decide(self, candidates: Sequence[OuterReduction], bounds: Sequence[int], overlap: int, interval: int,
               world_size: int, group: Any, device: torch.device) -> int:
        """Choose a candidate (module docstring); collective: every rank calls it at the same inner step."""
        self.step_s = -max_over_ranks([-self.measured_step_s()], group, device)[0]  # the least over the ranks
        steps = overlap if overlap > 0 else BLOCKING_FRACTION * interval
        self.window_s = steps * self.step_s
        window = (f"{overlap} overlapped steps" if overlap > 0 else f"{BLOCKING_FRACTION:.0%} of {interval} steps "
                  "(blocking syncs)") + f" x {self.step_s * 1e3:.1f} ms = {self.window_s * 1e3:.1f} ms"
        last = len(CANDIDATES) - 1
        if self.costs is None or self.link is None:
            choice, why = last, f"device calibration failed ({self.failed}): the fewest bytes"
        else:
            cost = self.costs[CANDIDATES[-1][0]]
            for (label, _, _), red in zip(CANDIDATES, candidates):
                c = self.costs.get(label, cost)
                worst = 0.0
                for f in range(len(bounds) - 1):
                    lo, hi = bounds[f], bounds[f + 1]
                    entries = [Entry(int(torch.Size(s).numel()), on) for s, on in zip(red.shapes[lo:hi], red.compressed[lo:hi])]
                    worst = max(worst, predict(entries, world_size, self.link, c, red.codec, red.algorithm)["compressed"])
                self.predicted[label] = worst
            fits = [i for i, (label, _, _) in enumerate(CANDIDATES) if self.predicted[label] <= self.window_s]
            choice = fits[0] if fits else last
            pred = ", ".join(f"{label} {self.predicted[label] * 1e3:.1f} ms" for label, _, _ in CANDIDATES)
            why = (f"{'the most exact that fits' if fits else 'none fits: the fewest bytes'} (predicted sync {pred}; "
                   f"window {window}; link {self.link.gbit:.3g} Gbit/s, {self.link.alpha * 1e6:.0f} us/message"
                   f"{' (given)' if self.forced_link else ''})")
        agreed = max_over_ranks([float(choice), -float(choice)], group, device)
        if agreed[0] != -agreed[1]:  # the same numbers give the same choice: this would be a bug
            raise ConfigurationError(f"codec='auto': ranks chose differently (candidates {int(-agreed[1])}..{int(agreed[0])})")
        self.choice, self.reason = choice, why
        return choice

    def adopt(self, choice: int | None, reason: str) -> None:
        """Take ``choice`` (a checkpoint's; None: undecided) without measuring."""
        self.choice, self.reason = choice, reason

    def config(self) -> str:
        """The choice as a configuration entry: a candidate's label, or "undecided"."""
        return "undecided" if self.choice is None else CANDIDATES[self.choice][0]

    def stats(self) -> dict[str, float]:
        """``auto_choice`` (-1 undecided), window, step compute, link and the predicted seconds of every candidate."""
        s = {"auto_choice": float(-1 if self.choice is None else self.choice), "auto_window_s": self.window_s,
             "auto_step_s": self.step_s}
        if self.link is not None:
            s["auto_link_alpha_s"] = self.link.alpha
            s["auto_link_gbit"] = self.link.gbit if math.isfinite(self.link.gbit) else 0.0
        s.update({f"auto_predicted_{k}_s": v for k, v in self.predicted.items()})
        return s


def parse_choice(value: Any) -> int | None:
    """A checkpoint's ``outer_auto`` entry as a candidate index (None: undecided), or ValueError."""
    if value == "undecided":
        return None
    labels = [label for label, _, _ in CANDIDATES]
    if value not in labels:
        raise ValueError(f"config.outer_auto must be one of {labels} or 'undecided', got {value!r:.40}")
    return labels.index(value)


__all__ = ["AUTO_OPTIONS", "BLOCKING_FRACTION", "CANDIDATES", "PROVISIONAL", "OuterAuto", "parse_choice"]
