"""Adam / AdamW: compressed momentum with the variance frozen after warm-up (1-bit Adam's recipe).

:func:`adopt_adam` decides whether the mode can drive the user's optimizer and how (the bound's
windows, masking, the warm-up it needs); :class:`FrozenVarianceAdam` applies the update from the
averaged compressed momentum. Adapter-neutral: parameters are known by ``id`` and name only.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import torch

from ..codecs import Codec
from .momentum import MomentumCorrection, MomentumRule, as_velocity
from .warmup import DEFAULT_WARMUP_STEPS

logger = logging.getLogger("commpress")


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
        #: the adapter keeps updating ``v`` after the warm-up (FSDP's ``adam_variance="live"``):
        #: bias-correct it at the current step instead of the step it froze at
        self.live_variance = False
        #: ``id(param) -> b2`` of the compressed parameters (the adapter's live-variance update reads it)
        self.beta2 = {id(p): float(g["betas"][1]) for g in optimizer.param_groups for p in g["params"]
                      if id(p) in self.compressed}
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

    def start(self, correction: MomentumCorrection) -> None:
        """At the end of warm-up: the hook compresses ``b1`` momenta from now on (``v`` freezes).

        A resumed run keeps the velocity it loaded; otherwise the optimizer's ``exp_avg`` is the start.
        """
        correction.rules = self.rules()
        for name, m in self.momenta().items():
            correction.velocity.setdefault(name, as_velocity(m))
        self.active = True

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
                    torch.div(st["exp_avg"], self._denominator(p, st["exp_avg_sq"], b2, eps, int(step)), out=update)
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

    def _denominator(self, p: torch.Tensor, v: torch.Tensor, b2: float, eps: float, step: int) -> torch.Tensor:
        """Adam's ``sqrt(v / (1 - b2**t_freeze)) + eps``, computed once while ``v`` stays frozen.

        With :attr:`live_variance` the bias correction is the current step's, ``1 - b2**step``
        (``v`` then changes every step, so the cache recomputes every step).

        Cached per parameter with ``v`` itself and its version counter, so a
        ``load_state_dict`` (a new tensor) or any in-place change of ``v`` recomputes it;
        saves two passes over the parameter per step for one more parameter-sized buffer.
        """
        t = step if self.live_variance else self.freeze_step
        key = (v._version, t, b2, eps)
        cached = self._denominators.get(p)
        if cached is None or cached[0] is not v or cached[1] != key:
            # A live variance recomputes every step: reuse the buffer (same shape) instead of allocating.
            old = None if cached is None else cached[2]
            if old is not None and old.shape == v.shape and old.dtype == v.dtype:
                denom = torch.sqrt(v, out=old)
            else:
                denom = torch.sqrt(v)
            denom.div_(math.sqrt(1.0 - b2**t)).add_(eps)
            cached = self._denominators[p] = (v, key, denom)
        return cached[2]

    def _post_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        for p, grad in self._hidden.items():
            p.grad = grad
        self._hidden.clear()


def adopt_adam(
    optimizer: torch.optim.Optimizer, params: Mapping[int, tuple[str, int]], codec: Codec, warmup_steps: int,
    masking: bool | None,
) -> tuple[FrozenVarianceAdam | None, int, bool | None]:
    """Drive ``optimizer`` with compressed momentum where the mode supports it.

    ``params``: ``id(parameter) -> (name, numel)`` of the compressed parameters. Returns the mode
    (None where the optimizer runs unchanged, with a warning saying why), the warm-up steps it
    needs (0 is raised to :data:`~.warmup.DEFAULT_WARMUP_STEPS`: the variance must settle before
    it freezes) and the masking choice (``None``: on for sparse codecs).
    """
    reason = adam_unsupported(optimizer)
    if reason is not None:
        logger.warning("commpress: %s: the optimizer runs unchanged on compressed gradients", reason)
        return None, warmup_steps, masking
    if warmup_steps == 0:
        warmup_steps = DEFAULT_WARMUP_STEPS
        logger.info("commpress: %d dense warm-up steps before Adam's variance freezes", DEFAULT_WARMUP_STEPS)
    compressed = {pid: name for pid, (name, _) in params.items()}
    windows = {}  # top-k's sends hold ~1/ratio steps of momentum: widen Adam's bound as much
    if codec.sparse and not codec.value_blind:
        for pid, (_, numel) in params.items():
            delta = codec.delta(numel)
            if delta:
                windows[pid] = 1.0 / delta
    adam = FrozenVarianceAdam(optimizer, compressed, warmup_steps, windows)
    if codec.value_blind:
        logger.warning(
            "commpress: %r with %s: each element's momentum reaches the optimizer about once "
            "per 1/ratio steps, and no update rule measured made that track dense (byte LM, "
            "AdamW, 200 steps: +3.4%% held-out loss at ratio 0.01, +2.8%% at 0.1; top-k 1%% "
            "+1.3%%); prefer \"topk\" with Adam (docs/benchmarks.md)", codec, type(optimizer).__name__,
        )
    if masking is None and codec.sparse:
        # measured on the 10.8M-parameter byte LM (AdamW, 2 ranks, 200 steps): top-k 1%
        # held-out loss 2.5615 -> 2.5355 (dense 2.4855); on SGD digits it cost top-k 0.8 points
        masking = True
    logger.info("commpress: %s momentum compressed for %d parameters after step %d (1-bit Adam's recipe)",
                type(optimizer).__name__, len(compressed), warmup_steps)
    return adam, warmup_steps, masking


__all__ = ["FrozenVarianceAdam", "adam_unsupported", "adopt_adam", "is_adam_like"]
