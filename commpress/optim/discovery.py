"""Find the user's optimizer at its first step, for adapters registered without ``optimizer=``.

Most users register a communication hook the way PyTorch's own hooks are registered, with no
optimizer argument, and error feedback feeding an optimizer's momentum converges worse (digits
MLP, the user's SGD momentum 0.9: sign 90.4% and random-k 70.3% without ``optimizer=``, 97.5%
and 97.2% with it; ``NO_OPTIMIZER=1 ../shared/checks/defaults_digits.py``). torch calls a global
hook after every ``Optimizer.step`` (``register_optimizer_step_post_hook``): :class:`OptimizerDiscovery`
watches it until an optimizer steps the adapter's parameters, hands that optimizer to the
adapter, which from the next step on behaves as if it had been passed, and stops watching.

Adoption happens *after* that first step, so the step runs as the user built it: the first
gradient is reduced without the mode and the optimizer applies its own momentum to it; its
momentum buffers then become the hook's velocities (as after a warm-up). An optimizer that
steps only some of the adapter's parameters (several optimizers, a subset) is not adopted: a log
line names it and what to pass instead, and everything runs unchanged. Every rank runs the same
training code, so every rank adopts at the same step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

logger = logging.getLogger("commpress")

#: The default of ``register(..., optimizer=...)``: find the optimizer at its first step.
DISCOVER = "auto"


class OptimizerDiscovery:
    """Watch every optimizer's steps until one steps ``params``; then call ``adopt(optimizer)``.

    Args:
        params: the adapter's parameters (compared by identity).
        adopt: called once, after the first step of an optimizer that steps every one of them.
        what: the adapter, for log lines (``"commpress.ddp.register"``).
    """

    __slots__ = ("_ids", "_adopt", "_what", "_handle")

    def __init__(self, params: Collection[torch.nn.Parameter], adopt: Callable[[torch.optim.Optimizer], None],
                 what: str) -> None:
        self._ids = {id(p) for p in params}
        self._adopt = adopt
        self._what = what
        self._handle: Any = register_optimizer_step_post_hook(self._after_step)

    @property
    def pending(self) -> bool:
        """True until an optimizer was adopted or refused (or :meth:`close`)."""
        return self._handle is not None

    def close(self) -> None:
        """Stop watching (idempotent)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        mine = len(stepped & self._ids)
        if not mine:
            return  # another model's optimizer
        self.close()
        if mine < len(self._ids):
            logger.warning(
                "commpress: %s: %s steps %d of the %d parameters the hook reduces, so its momentum "
                "stays in the optimizer; pass an optimizer over all of them as optimizer=, or "
                "optimizer=None to silence this", self._what, type(optimizer).__name__, mine, len(self._ids),
            )
            return
        logger.info("commpress: %s: adopted %s after its first step (as if passed as optimizer=)",
                    self._what, type(optimizer).__name__)
        self._adopt(optimizer)


__all__ = ["DISCOVER", "OptimizerDiscovery"]
