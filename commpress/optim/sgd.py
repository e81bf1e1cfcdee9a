"""The SGD hand-over: move the user's SGD momentum into the hook, and hand it back while nothing compresses.

:func:`take_over_momentum` does this to a user's ``torch.optim.SGD`` (or any optimizer whose
param groups have ``momentum`` / ``dampening`` / ``nesterov``):

- each param group's momentum settings move into ``group["commpress_momentum"]`` and the group's
  own ``momentum`` becomes 0, so ``optimizer.state_dict()`` / ``load_state_dict()`` carry what the
  hook applies, whichever order the user restores things in;
- a ``momentum_buffer`` already in the optimizer's state (a checkpoint from a dense run) becomes
  the initial velocity, so nothing is lost;
- learning rate and weight decay stay with the optimizer (weight decay is then not amplified by
  the momentum: for ``weight_decay=w`` the decay per step is ``lr * w``, as in DGC's reference);
- a scheduler that sets ``momentum`` again (``OneCycleLR``) is followed at the next step;
- :func:`give_back_momentum` undoes it: ``codec="auto"`` hands the momentum back while no bucket
  compresses (the velocities, averaged over ranks, become ``momentum_buffer``), and takes it
  again with :func:`take_over_momentum` before one does.

:class:`SGDHandover` is the mode object an adapter holds: the optimizer's hooks, where the
momentum is applied now, the averaging all-reduce of a hand-back and the checkpoint's velocities.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..comm.faults import FaultChannel, wait
from ..feedback import residual_dtype
from .momentum import MomentumCorrection, MomentumRule, as_velocity

#: Param-group key where the momentum settings the hook applies are kept.
GROUP_KEY = "commpress_momentum"
logger = logging.getLogger("commpress")


def is_sgd_like(optimizer: torch.optim.Optimizer) -> bool:
    """True when every param group has SGD's momentum settings (``torch.optim.SGD`` and kin).

    SGD's momentum comes with ``dampening`` and ``nesterov``; RMSprop's ``momentum`` (no
    dampening) acts on the normalized step, so moving it into the hook would change RMSprop.
    """
    return all(GROUP_KEY in g or ("momentum" in g and "dampening" in g) for g in optimizer.param_groups)


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


def give_back_momentum(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], velocities: Mapping[str, torch.Tensor]
) -> None:
    """Undo :func:`take_over_momentum`: the optimizer applies its momentum again.

    Each group's settings come back from ``group["commpress_momentum"]``; ``velocities`` (by
    parameter name, flat, the *average* over ranks so that every rank steps alike) become the
    ``momentum_buffer`` entries, in the parameter's dtype. A parameter without one starts its
    buffer from its next gradient, as ``torch.optim.SGD`` does.
    """
    for group in optimizer.param_groups:
        taken = group.get(GROUP_KEY)
        if not taken or not taken.get("momentum"):
            continue
        group["momentum"] = float(taken["momentum"])
        group["dampening"] = float(taken.get("dampening", 0.0))
        if "nesterov" in group:
            group["nesterov"] = bool(taken.get("nesterov", False))
        for p in group["params"]:
            v = velocities.get(names.get(id(p), ""))
            if v is not None:
                optimizer.state[p]["momentum_buffer"] = v.detach().reshape(p.shape).to(p.dtype, copy=True)


class SGDHandover:
    """Where the user's SGD momentum is applied: in the hook (:class:`MomentumCorrection`) or the optimizer.

    Built when the hook takes the momentum over (the constructor does :func:`take_over_momentum`
    and installs the optimizer's hooks). After every ``optimizer.step()``, ``want_optimizer()``
    (``codec="auto"``: every bucket exact) decides where the next step applies it; a hand-back
    averages the velocities over ``group`` once (bounded by ``faults``) and gives them to the
    optimizer as ``momentum_buffer``; a take-back makes the buffers every rank's velocity.

    Args:
        optimizer: the user's SGD-like optimizer.
        names: ``id(parameter) -> name`` of the parameters the adapter reduces.
        correction: the velocities and rules the hook applies.
        shapes: ``name -> (numel, dtype)`` of those parameters (the hand-back's buffers).
        group, faults: the process group and its fault channel (the hand-back's all-reduce).
        device: where the velocities live.
        want_optimizer: True when the optimizer should apply the momentum from the next step.
        where: the current step, for logs and the fault channel's messages.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, names: Mapping[int, str], correction: MomentumCorrection,
        shapes: Mapping[str, tuple[int, torch.dtype]], *, group: Any, faults: FaultChannel,
        device: Callable[[], torch.device], want_optimizer: Callable[[], bool], where: Callable[[], str],
    ) -> None:
        self.optimizer = optimizer
        self.names = dict(names)
        self.correction = correction
        self.shapes = dict(shapes)
        self.group = group
        self.faults = faults
        self.device = device
        self.want_optimizer = want_optimizer
        self.where = where
        self.in_optimizer = False
        self.handovers = 0
        # buffers found become velocities: e.g. resuming from a dense run's checkpoint (a gain
        # parameter folds it in when it compresses)
        self.take()

        def resync(*_: Any) -> None:  # before every step (schedulers)
            if not self.in_optimizer:  # handed back, a scheduler's change is the optimizer's
                self.take()

        # after load_state_dict the loaded groups and buffers decide, wherever the momentum was: the hook takes them
        optimizer.register_load_state_dict_post_hook(lambda *_: self.take())
        optimizer.register_step_pre_hook(resync)
        optimizer.register_step_post_hook(lambda *_: self.place())

    def place(self) -> None:
        """After ``optimizer.step()``: put the momentum where the next step needs it (all ranks alike).

        Momentum correction is needed only where a bucket compresses. While every bucket is
        exact, the optimizer applying its own momentum is the same update (averaging is
        linear), with SGD's own fused passes where the hook's cost 6-7% of a step
        (``scripts/bench_hook_overhead.py``). Weight decay then goes through the momentum, as
        ``torch.optim.SGD`` defines it, instead of being applied once per step.
        """
        if not self.correction.rules:
            return
        want = self.want_optimizer()
        if want == self.in_optimizer:
            return
        if want:
            with self.faults.guarded(f"{self.where()}, momentum hand-back"):  # never waits for a failed rank
                self.give()
        else:
            self.take()
        self.handovers += 1
        logger.info("commpress: %s: SGD momentum now applied by the %s", self.where(),
                    "optimizer (every bucket exact)" if want else "hook (a bucket compresses)")

    def take(self, keep_velocity: bool = False) -> None:
        """The hook applies the momentum: groups' momentum to 0, buffers (unless ``keep_velocity``) to velocities."""
        self.in_optimizer = False
        self.correction.rules, found = take_over_momentum(self.optimizer, self.names)
        if not keep_velocity:
            for name, buf in found.items():
                self.correction.velocity[name] = as_velocity(buf)

    def give(self) -> None:
        """The optimizer applies the momentum: the velocities averaged over ranks become its buffers."""
        velocity = self.correction.velocity
        names = sorted(self.correction.rules)  # the same on every rank (checked at registration)
        averaged: dict[str, torch.Tensor] = {}
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name in names:
            by_dtype.setdefault(residual_dtype(self.shapes[name][1]), []).append(name)
        device = self.device()
        world_size = dist.get_world_size(self.group)
        for dtype, members in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
            # each velocity, or zeros where this rank has none, then one count per parameter
            parts = [velocity[n].reshape(-1).to(dtype) if n in velocity
                     else torch.zeros(self.shapes[n][0], dtype=dtype, device=device) for n in members]
            parts.append(torch.tensor([float(n in velocity) for n in members], dtype=dtype, device=device))
            flat = torch.cat(parts)
            if world_size > 1:  # bounded by the fault channel, as the hook's collectives are
                wait(dist.all_reduce(flat, group=self.group, async_op=True), flat.device)
            counts = flat[-len(members):].tolist()
            offset = 0
            for n, count in zip(members, counts):
                numel = self.shapes[n][0]
                if count > 0:
                    averaged[n] = flat[offset : offset + numel].div_(count)
                offset += numel
        self.correction.velocity = {}
        give_back_momentum(self.optimizer, self.names, averaged)
        self.in_optimizer = True

    def velocities(self) -> dict[str, torch.Tensor]:
        """The velocities to checkpoint: the hook's, or the optimizer's buffers while it has them."""
        if not self.in_optimizer:
            return {k: v.detach().clone() for k, v in self.correction.velocity.items()}
        out = {}
        for p, name in ((p, self.names.get(id(p))) for g in self.optimizer.param_groups for p in g["params"]):
            buf = self.optimizer.state.get(p, {}).get("momentum_buffer")
            if name is not None and isinstance(buf, torch.Tensor):
                out[name] = as_velocity(buf)
        return out

    def stats(self) -> dict[str, float]:
        """``momentum_in_optimizer`` and ``momentum_handovers`` for the adapter's ``stats()``."""
        return {"momentum_in_optimizer": float(self.in_optimizer), "momentum_handovers": float(self.handovers)}


__all__ = ["GROUP_KEY", "SGDHandover", "give_back_momentum", "has_momentum", "is_sgd_like", "take_over_momentum"]
