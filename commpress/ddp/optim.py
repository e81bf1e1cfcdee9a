"""Optimizer-aware compression: move the user's SGD momentum into the hook.

Error feedback hands the optimizer a gradient that is late by design (what was dropped is sent
later). Fed into the optimizer's momentum, that lateness is amplified 1/(1 - momentum) times and
replayed for many steps: measured on the digits MLP with the user's ``SGD(lr=0.1,
momentum=0.9)`` and 2 ranks, sign compression reached 21.7% accuracy (dense 97.7%). DGC's
momentum correction (Lin et al., 2018) fixes the order of operations instead: every rank keeps
a *local* velocity ``u = m*u + (1-d)*g`` and compresses ``u`` (with error feedback), and the
optimizer runs without momentum. For parameters sent dense this is exactly SGD momentum
(averaging is linear); for compressed ones the residual holds velocity, not stale gradients.

:func:`take_over_momentum` does this to a user's ``torch.optim.SGD`` (or any optimizer whose
param groups have ``momentum`` / ``dampening`` / ``nesterov``):

- each param group's momentum settings move into ``group["commpress_momentum"]`` and the group's
  own ``momentum`` becomes 0, so ``optimizer.state_dict()`` / ``load_state_dict()`` carry what the
  hook applies, whichever order the user restores things in;
- a ``momentum_buffer`` already in the optimizer's state (a checkpoint from a dense run) becomes
  the initial velocity, so nothing is lost;
- learning rate and weight decay stay with the optimizer (weight decay is then not amplified by
  the momentum: for ``weight_decay=w`` the decay per step is ``lr * w``, as in DGC's reference);
- a scheduler that sets ``momentum`` again (``OneCycleLR``) is followed at the next step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

#: Param-group key where the momentum settings the hook applies are kept.
GROUP_KEY = "commpress_momentum"


@dataclass(frozen=True)
class MomentumRule:
    """SGD momentum as ``torch.optim.SGD`` defines it, applied by the hook to one parameter."""

    momentum: float
    dampening: float = 0.0
    nesterov: bool = False

    def as_list(self) -> list[Any]:
        """Plain form for configs and checkpoints."""
        return [self.momentum, self.dampening, self.nesterov]


def is_sgd_like(optimizer: torch.optim.Optimizer) -> bool:
    """True when every param group has SGD's momentum settings (``torch.optim.SGD`` and kin)."""
    return all("momentum" in g or GROUP_KEY in g for g in optimizer.param_groups)


def has_momentum(optimizer: torch.optim.Optimizer) -> bool:
    """True when some param group of an SGD-like optimizer uses momentum (or the hook does)."""
    return any(g.get("momentum", 0) or g.get(GROUP_KEY, {}).get("momentum", 0) for g in optimizer.param_groups)


def take_over_momentum(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str]
) -> tuple[dict[str, MomentumRule], dict[str, torch.Tensor]]:
    """Move momentum from ``optimizer``'s param groups to the hook (idempotent).

    ``names`` maps ``id(parameter)`` to its name. Returns the rule of every parameter whose
    group has momentum, and the momentum buffers found in the optimizer's state (by name),
    which the caller uses as initial velocities. Safe to call again after
    ``optimizer.load_state_dict`` or a scheduler's change: it adopts a non-zero ``momentum``.
    """
    rules: dict[str, MomentumRule] = {}
    buffers: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        taken = dict(group.get(GROUP_KEY) or {"momentum": 0.0, "dampening": 0.0, "nesterov": False})
        if group.get("momentum", 0):  # first time, a dense checkpoint, or a scheduler's change
            taken = {
                "momentum": float(group["momentum"]),
                "dampening": float(group.get("dampening", 0.0)),
                "nesterov": bool(group.get("nesterov", False)),
            }
        group[GROUP_KEY] = taken
        group["momentum"] = 0.0
        if "nesterov" in group:
            group["nesterov"] = False  # torch rejects Nesterov without momentum
        rule = MomentumRule(taken["momentum"], taken["dampening"], taken["nesterov"])
        for p in group["params"]:
            name = names.get(id(p))
            buf = optimizer.state.get(p, {}).pop("momentum_buffer", None)
            if name is None:
                continue
            if rule.momentum:
                rules[name] = rule
            if isinstance(buf, torch.Tensor):
                buffers[name] = buf
    return rules, buffers


def check_rule(value: Any, what: str) -> MomentumRule:
    """Validate a checkpointed ``[momentum, dampening, nesterov]``; ValueError naming ``what``."""
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise ValueError(f"{what}: expected [momentum, dampening, nesterov], got {value!r}")
    m, d, nesterov = value
    if not isinstance(m, (int, float)) or not 0.0 <= float(m) < 1.0:
        raise ValueError(f"{what}: momentum must be in [0, 1), got {m!r}")
    if not isinstance(d, (int, float)) or not 0.0 <= float(d) <= 1.0 or not isinstance(nesterov, bool):
        raise ValueError(f"{what}: dampening must be in [0, 1] and nesterov a bool, got {d!r}, {nesterov!r}")
    return MomentumRule(float(m), float(d), nesterov)


__all__ = ["GROUP_KEY", "MomentumRule", "check_rule", "has_momentum", "is_sgd_like", "take_over_momentum"]
