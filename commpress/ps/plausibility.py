"""Plausibility of pushed values: the running norm of accepted pushes and the bound on the next one.

A push can be valid bytes with a valid CRC and still carry a value no gradient has (a flipped
exponent bit: the red-team took digits from 85.8% to 20.6% accuracy that way). Each server keeps
a running norm of the pushes it accepted (an average with weight 0.1 per push, seeded by the
median of the first ``W`` pushes, which are accepted as they come); a push whose decoded norm
exceeds ``max_push_norm`` times it (default 1000; 0 disables the check) is dropped like a skip
push, counted per sender in ``stats.implausible``, logged with its worker and norm, and the step
goes on without it. A dropped push leaves the running norm as it was, so a run whose gradients
legitimately grow 1000x within ~10 pushes would keep dropping them: raise the factor there. It
bounds mistakes, not an adversary who inflates values slowly, and, like the CRC, it is not
authentication.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import numpy as np
import torch

from .stats import Stats

logger = logging.getLogger("commpress")


class PushNormCheck:
    """The running norm of the pushes server ``index`` accepted, and the report of those it drops.

    Args:
        factor: ``max_push_norm``: a push may be at most this many times the running norm (0: off).
        workers: ``W``: the first ``W`` pushes are accepted and seed the norm with their median.
        index: the server's shard (named in the log lines).
        stats: the server's counters (``implausible`` per sender rank).
        event: the server's event logger (``event(**fields)``).
    """

    def __init__(self, factor: float, workers: int, index: int, stats: Stats,
                 event: Callable[..., None]) -> None:
        self.factor = float(factor)
        self.workers = workers
        self.index, self.stats, self.event = index, stats, event
        self.norm = 0.0  # running norm of accepted pushes (0: not seeded yet)
        self._first: list[float] = []  # the first W pushes' norms, which seed it

    @property
    def enabled(self) -> bool:
        """Whether pushes are checked at all (``max_push_norm`` != 0)."""
        return bool(self.factor)

    def bound(self) -> float:
        """The largest norm a push may have now (0 while the running norm is not seeded)."""
        return self.factor * self.norm

    def judge(self, grad: torch.Tensor) -> tuple[bool, float]:
        """``(accepted, norm)`` of the decoded push ``grad``; an accepted norm updates the running norm."""
        norm = float(torch.linalg.vector_norm(grad, dtype=torch.float64))
        if not math.isfinite(norm) or (self.norm > 0 and norm > self.bound()):
            return False, norm
        if len(self._first) < self.workers:  # seeding: accept, then start from the median
            self._first.append(norm)
            if len(self._first) == self.workers:
                self.norm = float(np.median(self._first))
        else:
            self.norm = 0.9 * self.norm + 0.1 * norm if self.norm > 0 else norm
        return True, norm

    def admit(self, worker: int, step: int, grad: torch.Tensor, sender: int) -> str | None:
        """Judge worker ``worker``'s decoded push; None if accepted, else why (counted and logged)."""
        bound = self.bound()
        ok, norm = self.judge(grad)
        if ok:
            return None
        n = self.stats.implausible.get(sender, 0) + 1
        self.stats.implausible[sender] = n
        reason = f"PUSH at step {step}: norm {norm:.3g} exceeds {self.factor:g} x the running norm {self.norm:.3g}"
        self.event(event="implausible", rank=sender, step=step, norm=norm, bound=bound)
        if n <= 10 or n % 100 == 0:
            logger.warning("[commpress.ps server %d] dropped a push of worker %d (rank %d): %s", self.index, worker,
                           sender, reason)
        return reason


__all__ = ["PushNormCheck"]
