"""The checkpoint form of a DDP :class:`~.state.CompressionState`, and the all-or-nothing validation of a load.

What is saved: residuals (keyed by parameter name), codec configuration, step and seed, the
momentum's rules and velocities, the guard's counters and the collectives' counters; this rank's
only (residuals differ per rank), plain types and tensors so ``torch.load(..., weights_only=True)``
reads it back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..comm import CommStats
from ..feedback import check_state_header
from ..optim import MomentumCorrection

if TYPE_CHECKING:
    from .state import CompressionState

STATE_FORMAT = 1


def state_dict(state: CompressionState) -> dict[str, Any]:
    """Residuals (keyed by parameter name), codec config, step and seed; this rank's only.

    Error-feedback residuals differ per rank: save one file per rank. Only tensors and
    plain types, so ``torch.load(..., weights_only=True)`` reads it back.
    """
    return {
        "format": STATE_FORMAT,
        "codec": state.codec.config(),
        "algorithm": state.algorithm,
        "error_feedback": state.error_feedback,
        "world_size": state.world_size,
        "rank": state.rank,
        "seed": state.seed,
        "step": state.step,
        "shapes": {p.name: list(p.shape) for p in state.plans.values() if p.compressed},
        "momentum": state.momentum,
        "momentum_rules": {k: r.as_list() for k, r in state.momentum_rules.items()},
        "velocity": _velocities(state),
        "guard": state.guard.state(),
        "stats": state._stats.as_dict(),
        "stats_from_step": state._stats_from_step,
        "feedback": None if state.feedback is None else state.feedback.state_dict(),
        "server_feedback": None if state.server_feedback is None else state.server_feedback.state_dict(),
    }


def _velocities(state: CompressionState) -> dict[str, torch.Tensor]:
    """The velocities to checkpoint: the hook's, or the optimizer's buffers while it has them."""
    if state.handover is not None:
        return state.handover.velocities()
    return {k: v.detach().clone() for k, v in state.velocity.items()}


def load_state_dict(state: CompressionState, saved: Mapping[str, Any]) -> None:
    """Validate all of ``saved`` against ``state``, then restore it (nothing changes on an error)."""
    required = {
        "algorithm", "error_feedback", "world_size", "rank", "seed", "step",
        "shapes", "feedback", "server_feedback", "momentum", "velocity",
    }
    check_state_header(saved, required=required, fmt=STATE_FORMAT, codec=state.codec, what="commpress DDP state")
    if saved["algorithm"] != state.algorithm:
        raise ValueError(f"algorithm mismatch: checkpoint has {saved['algorithm']!r}, this state {state.algorithm!r}")
    if saved["world_size"] != state.world_size:
        raise ValueError(
            f"world size mismatch: checkpoint was written by {saved['world_size']} ranks, this process "
            f"group has {state.world_size} (residuals are per rank and cannot be redistributed)"
        )
    if saved["rank"] != state.rank:
        raise ValueError(
            f"rank mismatch: this is rank {state.rank}'s state slot but the checkpoint is rank "
            f"{saved['rank']}'s; save and load one commpress state per rank"
        )
    if bool(saved["error_feedback"]) != state.error_feedback:
        raise ValueError(
            f"error_feedback mismatch: checkpoint {saved['error_feedback']!r}, this state {state.error_feedback!r}"
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
    mine = {p.name: list(p.shape) for p in state.plans.values() if p.compressed}
    theirs = {str(k): [int(d) for d in v] for k, v in dict(saved["shapes"]).items()}
    if theirs != mine:
        extra, lost = sorted(set(theirs) - set(mine)), sorted(set(mine) - set(theirs))
        changed = sorted(k for k in set(mine) & set(theirs) if mine[k] != theirs[k])
        raise ValueError(
            "compressed parameters differ from the checkpoint: "
            f"only in checkpoint {extra}, only here {lost}, shape changed {changed}"
        )
    if float(saved["momentum"]) != state.momentum:
        raise ValueError(f"momentum mismatch: checkpoint {saved['momentum']!r}, this state {state.momentum!r}")
    saved_rules = MomentumCorrection.load_rules(saved.get("momentum_rules"))
    if state.optimizer is None and saved_rules != state.momentum_rules:
        raise ValueError(
            "momentum rules differ from the checkpoint (it was written with optimizer=...): "
            "register with the same optimizer settings"
        )
    velocity = MomentumCorrection.load_velocities(saved["velocity"], {n: p.numel for n, p in state.plans.items()})
    worker, server = state._new_feedback()
    for what, fb, saved_fb in (
        ("feedback", worker, saved["feedback"]), ("server_feedback", server, saved["server_feedback"]),
    ):
        if (fb is None) != (saved_fb is None):
            raise ValueError(f"{what}: checkpoint {'has' if saved_fb is not None else 'lacks'} it, this state does not agree")
        if fb is not None:
            fb.load_state_dict(saved_fb)  # validates keys, shapes, dtypes, finiteness
    if "guard" in saved:
        state.guard.load(saved["guard"])
    state.feedback, state.server_feedback = worker, server
    if state.momentum_in_optimizer:  # the checkpoint's velocities are the momentum now: the hook applies it
        assert state.handover is not None
        state.handover.take(keep_velocity=True)
    state.correction.velocity = velocity
    state.step, state.seed = step, seed
    state._stats.load(stats.as_dict())  # in place: the collectives hold this object
    state._stats_from_step = stats_from
