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
- a scheduler that sets ``momentum`` again (``OneCycleLR``) is followed at the next step;
- :func:`give_back_momentum` undoes it: ``codec="auto"`` hands the momentum back while no bucket
  compresses (the velocities, averaged over ranks, become ``momentum_buffer``), and takes it
  again with :func:`take_over_momentum` before one does.
"""

from __future__ import annotations

import math
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

    @property
    def gain(self) -> float:
        """What the velocity multiplies a constant gradient by in the long run.

        ``u = m*u + (1-d)*g`` settles at ``(1-d)/(1-m) * g``; Nesterov's ``g + m*u`` at
        ``(1 + m(1-d)/(1-m)) * g``. Used instead of a velocity where the residual already holds
        each element for far longer than the momentum remembers (value-blind codecs).
        """
        m, d = self.momentum, self.dampening
        return 1.0 + m * (1.0 - d) / (1.0 - m) if self.nesterov else (1.0 - d) / (1.0 - m)

    @property
    def pending(self) -> float:
        """What a velocity ``u`` still moves the parameter by with no further gradient, over ``u``.

        ``u_k = m**k * u`` steps on as ``u_k`` (plain) or ``m * u_k`` (Nesterov): summed over
        ``k >= 1``, ``m/(1-m)`` or ``m**2/(1-m)`` times ``u``.
        """
        m = self.momentum
        return (m * m if self.nesterov else m) / (1.0 - m)

    def as_list(self) -> list[Any]:
        """Plain form for configs and checkpoints."""
        return [self.momentum, self.dampening, self.nesterov]


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

    ``codec="auto"`` does this while every bucket is reduced exactly (see
    :meth:`CompressionState.place_momentum`).
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


# ----- Adam / AdamW: compressed momentum with the variance frozen after warm-up ----------------
def is_adam_like(optimizer: torch.optim.Optimizer) -> bool:
    """True for Adam-style optimizers (every group has ``betas`` and ``eps``)."""
    return all("betas" in g and "eps" in g for g in optimizer.param_groups)


def adam_unsupported(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the compressed-momentum mode cannot drive ``optimizer`` (None when it can)."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return f"{type(optimizer).__name__} is not torch.optim.Adam/AdamW"
    decoupled = isinstance(optimizer, torch.optim.AdamW)
    for g in optimizer.param_groups:
        for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
            if g.get(flag):
                return f"{flag}=True is not supported"
        if g.get("weight_decay") and not (decoupled or g.get("decoupled_weight_decay")):
            return "Adam's L2 weight decay (use AdamW)"
    return None


class FrozenVarianceAdam:
    """1-bit Adam's recipe (Tang et al., 2021) on a user's ``torch.optim.Adam`` / ``AdamW``.

    During the dense warm-up the optimizer runs unchanged and its second moment ``v`` settles.
    Then, for the compressed parameters, the hook keeps each rank's momentum
    ``m = b1*m + (1-b1)*g`` (started from the optimizer's ``exp_avg``) and sends it through
    error feedback; the averaged momentum arrives as the gradient, and a step pre-hook applies
    ``p -= lr * (m/bc1) / (sqrt(v/bc2) + eps)`` with ``v`` frozen (``bc2`` from the step at
    which it froze; each coordinate held to Adam's own bound ``(1-b1)/sqrt(1-b2)``, which a
    compressed momentum can exceed where ``v`` froze near zero), decoupled weight decay first,
    and writes ``m`` into ``exp_avg`` so the optimizer's state_dict holds what was applied. It then hides those gradients from the
    optimizer's own step (restored right after), so the optimizer updates only the dense ones.

    ``windows`` widens that bound per parameter (``id(param) -> steps``), for top-k: a value it
    sends is the momentum of every step since the element was last sent (about ``1/ratio``
    steps), so one step's bound cut most of it, and error feedback cannot return what the bound
    cut. The bound stays (times the window) because an element whose ``v`` froze near zero
    (a byte never seen in warm-up, or zeroed by a quantized warm-up) would otherwise move by
    ``m/eps``. Random-k keeps one step's bound: its sends are blind bursts of ~1/ratio steps,
    and with a wider bound it diverged on digits (95.7% -> 8.3%).
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, compressed: Mapping[int, str], freeze_step: int,
        windows: Mapping[int, float] | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.compressed = dict(compressed)  # id(param) -> name
        self.freeze_step = freeze_step
        self.windows = dict(windows or {})
        self.active = False
        self._hidden: dict[torch.Tensor, torch.Tensor] = {}
        self._scratch: dict[torch.Tensor, torch.Tensor] = {}
        self._denominators: dict[torch.Tensor, tuple[torch.Tensor, tuple[Any, ...], torch.Tensor]] = {}
        optimizer.register_step_pre_hook(self._pre_step)
        optimizer.register_step_post_hook(self._post_step)

    def rules(self) -> dict[str, MomentumRule]:
        """``m = b1*m + (1-b1)*g`` for every compressed parameter: momentum b1, dampening b1."""
        out = {}
        for g in self.optimizer.param_groups:
            b1 = float(g["betas"][0])
            for p in g["params"]:
                name = self.compressed.get(id(p))
                if name is not None:
                    out[name] = MomentumRule(b1, b1, False)
        return out

    def momenta(self) -> dict[str, torch.Tensor]:
        """The optimizer's ``exp_avg`` per compressed parameter (the hook's starting momentum)."""
        out = {}
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                name = self.compressed.get(id(p))
                m = self.optimizer.state.get(p, {}).get("exp_avg")
                if name is not None and isinstance(m, torch.Tensor):
                    out[name] = m
        return out

    def _pre_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if not self.active:
            return
        for g in optimizer.param_groups:
            lr, (b1, b2), eps, wd = float(g["lr"]), g["betas"], float(g["eps"]), float(g.get("weight_decay", 0.0))
            for p in g["params"]:
                if id(p) not in self.compressed or p.grad is None:
                    continue
                st = optimizer.state.get(p, {})
                if "exp_avg_sq" not in st:  # no warm-up state yet: the optimizer's own step
                    continue
                st["step"] += 1
                step = float(st["step"])
                with torch.no_grad():
                    st["exp_avg"].copy_(p.grad)
                    # one scratch buffer per parameter, reused: no allocation (page faults) per step
                    update = self._scratch.get(p)
                    if update is None:
                        update = self._scratch[p] = torch.empty_like(st["exp_avg_sq"])
                    torch.div(st["exp_avg"], self._denominator(p, st["exp_avg_sq"], b2, eps), out=update)
                    update.div_(1.0 - b1**step)
                    # Adam's own update never exceeds (1-b1)/sqrt(1-b2) per coordinate; a compressed
                    # momentum can (sign gives +-scale where v froze near 0): hold it to Adam's bound
                    bound = self.windows.get(id(p), 1.0) * (1.0 - b1) / math.sqrt(1.0 - b2)
                    update.clamp_(-bound, bound)
                    if wd:
                        p.mul_(1.0 - lr * wd)
                    p.add_(update, alpha=-lr)
                self._hidden[p] = p.grad
                p.grad = None

    def _denominator(self, p: torch.Tensor, v: torch.Tensor, b2: float, eps: float) -> torch.Tensor:
        """Adam's ``sqrt(v / (1 - b2**t_freeze)) + eps``, computed once while ``v`` stays frozen.

        Cached per parameter with ``v`` itself and its version counter, so a
        ``load_state_dict`` (a new tensor) or any in-place change of ``v`` recomputes it;
        saves two passes over the parameter per step for one more parameter-sized buffer.
        """
        key = (v._version, self.freeze_step, b2, eps)
        cached = self._denominators.get(p)
        if cached is None or cached[0] is not v or cached[1] != key:
            denom = torch.sqrt(v).div_(math.sqrt(1.0 - b2**self.freeze_step)).add_(eps)
            cached = self._denominators[p] = (v, key, denom)
        return cached[2]

    def _post_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        for p, grad in self._hidden.items():
            p.grad = grad
        self._hidden.clear()


#: Dense steps before compression starts where it needs a warm-up (Adam's variance freezing,
#: value-blind codecs) and the user sets no ``warmup_steps``.
DEFAULT_WARMUP_STEPS = 50

#: How warm-up steps are reduced when the user names no ``warmup_codec``: unbiased (nothing to
#: keep in residuals across the switch), 4x fewer bytes than the all-reduce, and measured no worse
#: than dense warm-up steps (see ``CompressionState``'s ``warmup_codec``).
DEFAULT_WARMUP_CODEC = "qsgd:bits=8"


__all__ = [
    "DEFAULT_WARMUP_CODEC", "DEFAULT_WARMUP_STEPS", "FrozenVarianceAdam", "GROUP_KEY", "MomentumRule", "adam_unsupported", "check_rule",
    "give_back_momentum", "has_momentum", "is_adam_like", "is_sgd_like", "take_over_momentum",
]
