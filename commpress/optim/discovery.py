"""Find the user's optimizer at its first step, for adapters registered without ``optimizer=``.

Most users register a communication hook the way PyTorch's own hooks are registered, with no
optimizer argument, and error feedback feeding an optimizer's momentum converges worse (digits
MLP, the user's SGD momentum 0.9: sign 90.4% and random-k 70.3% without ``optimizer=``, 97.5%
and 97.2% with it; ``NO_OPTIMIZER=1 ../shared/checks/defaults_digits.py``). torch calls a global
hook after every ``Optimizer.step`` (``register_optimizer_step_post_hook``): :class:`OptimizerDiscovery`
watches it until an optimizer steps the adapter's parameters, hands that optimizer to the
adapter, which from the next step on behaves as if it had been passed, and stops watching.

Before the first gradient is reduced, :meth:`OptimizerDiscovery.find_existing` looks among the
live objects for the optimizer (users build it before their first backward): found, it is
adopted there, and the run is the run with ``optimizer=`` from its first step (AdamW included,
whose warm-up must cover step 0: byte LM, 2 ranks, 200 steps, adopted after the first step
instead: top-k 1% +4.88% held-out loss vs dense and sign +2.20%, against +2.02% / +0.64% with
``optimizer=``). Otherwise adoption happens *after* that first step: the first gradient is
reduced without the mode and the optimizer applies its own momentum to it. An optimizer that
steps only some of the adapter's parameters (several optimizers, a subset) is not adopted: a log
line names it and what to pass instead, and everything runs unchanged. Every rank runs the same
training code, so every rank adopts at the same step.
"""

from __future__ import annotations

import gc
import logging
import warnings
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..comm.agreement import check_same_config

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

    def find_existing(self) -> torch.optim.Optimizer | None:
        """The one live optimizer stepping every one of the parameters, before it has stepped.

        One pass over the objects the garbage collector tracks (:func:`gc.get_objects`; the
        adapter calls it once, at its first bucket: 0.13 s over the 313k objects of a process
        holding the demo LM and its AdamW, measured on a loaded 2-core machine). Found, the watch stops and the caller adopts
        it; None when no optimizer or more than one steps all the parameters (the step hook then
        decides after the first step, and names a subset optimizer).
        """
        if self._handle is None:
            return None
        # isinstance on every tracked object reads deprecated module proxies too (torch's
        # `torch.distributed.reduce_op` warns when touched): their FutureWarning is not the user's
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            found = [obj for obj in gc.get_objects()
                     if isinstance(obj, torch.optim.Optimizer) and self._stepped(obj) == len(self._ids)]
        if len(found) != 1:
            return None
        self.close()
        logger.info("commpress: %s: adopted %s before its first step (as if passed as optimizer=)",
                    self._what, type(found[0]).__name__)
        return found[0]

    def find_agreed(self, *, group: Any, timeout_s: float) -> torch.optim.Optimizer | None:
        """:meth:`find_existing` on every rank of ``group``, which must all find the same kind (or none).

        A rank adopting while another does not would send frames of other sizes, so the kinds
        found are compared through the process group's store
        (:func:`~commpress.comm.agreement.check_same_config`: a :class:`ConfigurationError` on
        every rank when they differ). Every rank calls it once, at the same point.
        """
        optimizer = self.find_existing()
        found = type(optimizer).__name__ if optimizer is not None else None
        check_same_config({"optimizer_found_before_step_0": found}, summary=f"optimizer found: {found}",
                          group=group, timeout_s=timeout_s, what=f"the first backward after {self._what}")
        return optimizer

    def _stepped(self, optimizer: torch.optim.Optimizer) -> int:
        """How many of the parameters ``optimizer`` steps."""
        return len({id(p) for group in optimizer.param_groups for p in group["params"]} & self._ids)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        mine = self._stepped(optimizer)
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
