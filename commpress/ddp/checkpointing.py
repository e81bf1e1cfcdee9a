"""The checkpoint form of a DDP :class:`~.state.CompressionState`, and the all-or-nothing validation of a load.

What is saved: residuals (keyed by parameter name), codec configuration, step and seed, the
momentum's rules and velocities, the guard's counters and the collectives' counters; this rank's
only (residuals differ per rank), plain types and tensors so ``torch.load(..., weights_only=True)``
reads it back. :class:`DDPCheckpoint` is the state's base class: it names the attributes it reads.

A file written at another world size loads what is the same on every rank and drops the
per-rank residuals and velocities with one warning (:func:`resized_load` says why).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from .. import checkpoint
from ..codecs import Codec
from ..comm import CommStats
from ..feedback import check_state_header
from ..optim import (
    DivergenceGuard,
    MomentumCorrection,
    OptimizerDiscovery,
    OptimizerMode,
    SGDHandover,
)
from .planning import ParamPlan
from .residuals import ParamResiduals

STATE_FORMAT = 1
logger = logging.getLogger("commpress")


def resized_load(saved: Mapping[str, Any], velocity: Mapping[str, torch.Tensor], world_size: int, rank: int) -> str:
    """What a load at another world size drops, as the one warning it logs.

    A checkpoint written at ``W`` ranks loaded at ``W' != W``: the configuration, step, seed,
    counters, guard state, momentum rules and optimizer modes are loaded; this rank's
    error-feedback residuals and velocities start empty (a velocity starts from the next
    gradient, as in ``torch.optim.SGD``). :func:`commpress.checkpoint.resize_warning` says why
    they are dropped rather than redistributed.
    """
    return checkpoint.resize_warning(
        "commpress DDP state", saved, world_size, rank,
        kept=f"the configuration, step {saved['step']}, seed, counters, guard state and momentum rules",
        dropped={"error-feedback residual(s)": _residuals(saved), "velocity(ies)": velocity},
    )


def _residuals(saved: Mapping[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """The checkpoint's residual tensors, by feedback ("feedback", "server_feedback") and key."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key in ("feedback", "server_feedback"):
        fb = saved.get(key)
        if isinstance(fb, Mapping) and isinstance(fb.get("residuals"), Mapping):
            out[key] = {str(k): v for k, v in fb["residuals"].items() if isinstance(v, torch.Tensor)}
    return out


class DDPCheckpoint(checkpoint.StateFile):
    """``state_dict`` / ``load_state_dict`` of the DDP hook's state (its subclass sets these attributes)."""

    __slots__ = (
        "codec", "algorithm", "error_feedback", "world_size", "rank", "seed", "step", "plans", "momentum",
        "correction", "handover", "optimizer", "guard", "residuals", "modes", "_stats", "_stats_from_step",
        "discovery",
    )
    codec: Codec
    algorithm: str
    error_feedback: bool
    world_size: int
    rank: int
    seed: int
    step: int
    plans: dict[str, ParamPlan]
    momentum: float
    correction: MomentumCorrection
    handover: SGDHandover | None
    optimizer: torch.optim.Optimizer | None
    discovery: OptimizerDiscovery | None
    guard: DivergenceGuard
    residuals: ParamResiduals
    modes: tuple[OptimizerMode, ...]
    _stats: CommStats
    _stats_from_step: int

    def _new_residuals(self) -> ParamResiduals:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Residuals (keyed by parameter name), codec config, step and seed; this rank's only.

        Error-feedback residuals differ per rank: save one file per rank. Only tensors and
        plain types, so ``torch.load(..., weights_only=True)`` reads it back.
        """
        return {
            "format": STATE_FORMAT,
            "codec": self.codec.config(),
            "algorithm": self.algorithm,
            "error_feedback": self.error_feedback,
            "world_size": self.world_size,
            "rank": self.rank,
            "seed": self.seed,
            "step": self.step,
            "shapes": {p.name: list(p.shape) for p in self.plans.values() if p.compressed},
            "momentum": self.momentum,
            "momentum_rules": {k: r.as_list() for k, r in self.correction.rules.items()},
            "velocity": self._velocities(),
            "guard": self.guard.state(),
            "stats": self._stats.as_dict(),
            "stats_from_step": self._stats_from_step,
            "feedback": None if self.residuals.worker is None else self.residuals.worker.state_dict(),
            "server_feedback": None if self.residuals.server is None else self.residuals.server.state_dict(),
            **({"modes": {m.name: m.state_dict() for m in self.modes}} if self.modes else {}),
        }


    def _velocities(self) -> dict[str, torch.Tensor]:
        """The velocities to checkpoint: the hook's, or the optimizer's buffers while it has them."""
        if self.handover is not None:
            return self.handover.velocities()
        return {k: v.detach().clone() for k, v in self.correction.velocity.items()}


    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output after validating all of it (all or nothing).

        Raises ValueError (:class:`CodecError` for a codec mismatch) when the checkpoint was
        written with another codec or algorithm, by another rank of the same world size, or for
        other shapes, and for entries of the wrong type (a malformed or hostile checkpoint).
        Written at another world size, it loads all but this rank's residuals and velocities,
        which start empty, and logs one warning naming what was dropped (:func:`resized_load`).
        """
        try:
            self._load_state_dict(state)
        except (TypeError, OverflowError, KeyError, IndexError, AttributeError) as exc:
            raise ValueError(f"commpress DDP state: malformed entry ({type(exc).__name__}: {str(exc)[:200]})") from None

    def _load_state_dict(self, saved: Mapping[str, Any]) -> None:
        required = {
            "algorithm", "error_feedback", "world_size", "rank", "seed", "step",
            "shapes", "feedback", "server_feedback", "momentum", "velocity",
        }
        check_state_header(saved, required=required, fmt=STATE_FORMAT, codec=self.codec, what="commpress DDP state")
        if saved["algorithm"] != self.algorithm:
            raise ValueError(f"algorithm mismatch: checkpoint has {saved['algorithm']!r}, this state {self.algorithm!r}")
        # another world size: residuals and velocities are dropped (see resized_load)
        resized = checkpoint.resized(saved, self.world_size, self.rank,
                                     "residuals are per rank: save and load one commpress state per rank")
        if bool(saved["error_feedback"]) != self.error_feedback:
            raise ValueError(
                f"error_feedback mismatch: checkpoint {saved['error_feedback']!r}, this state {self.error_feedback!r}"
            )
        step, seed = saved["step"], saved["seed"]
        if not isinstance(step, int) or not 0 <= step < 1 << 62 or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
            raise ValueError(f"step must be an int in [0, 2**62) and seed in [0, 2**64), got {step!r} / {seed!r}")
        stats = CommStats()
        stats_from = step  # a checkpoint without counters: count from here
        if "stats" in saved:
            stats.load(dict(saved["stats"]))
            stats_from = saved.get("stats_from_step", 0)
            if not isinstance(stats_from, int) or not 0 <= stats_from <= step:
                raise ValueError(f"stats_from_step must be an int in [0, step], got {stats_from!r}")
        mine = {p.name: list(p.shape) for p in self.plans.values() if p.compressed}
        theirs = {str(k): [int(d) for d in v] for k, v in dict(saved["shapes"]).items()}
        if theirs != mine:
            extra, lost = sorted(set(theirs) - set(mine)), sorted(set(mine) - set(theirs))
            changed = sorted(k for k in set(mine) & set(theirs) if mine[k] != theirs[k])
            raise ValueError(
                "compressed parameters differ from the checkpoint: "
                f"only in checkpoint {extra}, only here {lost}, shape changed {changed}"
            )
        if float(saved["momentum"]) != self.momentum:
            raise ValueError(f"momentum mismatch: checkpoint {saved['momentum']!r}, this state {self.momentum!r}")
        saved_rules = MomentumCorrection.load_rules(saved.get("momentum_rules"))
        # an optimizer still to be discovered (no optimizer= given) takes the checkpoint's rules:
        # the resumed run's first step applies them before the optimizer is adopted
        discovering = self.discovery is not None and self.discovery.pending
        if self.optimizer is None and not discovering and saved_rules != self.correction.rules:
            raise ValueError(
                "momentum rules differ from the checkpoint (it was written with optimizer=...): "
                "register with the same optimizer settings"
            )
        velocity = MomentumCorrection.load_velocities(saved["velocity"], {n: p.numel for n, p in self.plans.items()})
        fresh = self._new_residuals()
        worker, server = fresh.worker, fresh.server
        for what, fb, saved_fb in (
            ("feedback", worker, saved["feedback"]), ("server_feedback", server, saved["server_feedback"]),
        ):
            if (fb is None) != (saved_fb is None):
                raise ValueError(f"{what}: checkpoint {'has' if saved_fb is not None else 'lacks'} it, this state does not agree")
            if fb is not None and not resized:
                fb.load_state_dict(saved_fb)  # validates keys, shapes, dtypes, finiteness
        if self.modes:
            saved_modes = dict(saved.get("modes") or {})
            if sorted(saved_modes) != sorted(m.name for m in self.modes):
                raise ValueError(f"modes differ: checkpoint has {sorted(saved_modes)}, this state "
                                 f"{sorted(m.name for m in self.modes)}")
        if "guard" in saved:
            self.guard.load(saved["guard"])
        for mode in self.modes:
            mode.load_state_dict(dict(saved_modes[mode.name]))
        if resized:
            dropped = resized_load(saved, velocity, self.world_size, self.rank)
        self.residuals = fresh
        if self.handover is not None and self.handover.in_optimizer:
            self.handover.take(keep_velocity=True)  # the checkpoint's velocities are the momentum now: the hook applies it
        self.correction.velocity = {} if resized else velocity
        if discovering:
            self.correction.rules = saved_rules
        self.step, self.seed = step, seed
        self._stats.load(stats.as_dict())  # in place: the collectives hold this object
        self._stats_from_step = stats_from
        if resized:
            logger.warning("%s", dropped)
