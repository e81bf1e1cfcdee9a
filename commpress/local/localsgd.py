"""Local SGD: every rank trains on its own for H steps, then all ranks average their parameters.

The simplest low-communication schedule (Stich, 2019; torchft's ``LocalSGD``): one dense
all-reduce of the flat parameters every ``sync_every`` inner steps instead of one of the
gradients every step, H times fewer bytes. There is no global copy and no outer optimizer
(that is :class:`~commpress.local.DiLoCo`); the inner optimizer's state stays local.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm import CommStats, allreduce_mean
from .schedule import SYNC_TIMEOUT_S, VERIFY_TIMEOUT_S, LocalSchedule


class LocalSGD(LocalSchedule):
    """Average the parameters of a plain module over the ranks every ``sync_every`` inner steps.

    Every rank ends each sync with bit-identical parameters (one all-reduce: every rank reads the
    same sum). A non-finite average (some rank diverged) raises :class:`FloatingPointError` on
    every rank at that sync: there is no earlier copy to go back to (DiLoCo keeps one and skips
    the outer step instead). A rank that dies or hangs between syncs ends every live rank at the
    next sync with :class:`~commpress.errors.RankFailedError` naming it, within ``sync_timeout``
    seconds (:mod:`.schedule`). Example::

        with commpress.local.LocalSGD(model, opt, sync_every=8) as local:
            for x, y in batches:
                opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        local.finish()  # averages the steps since the last sync (a loop ending between syncs)
    """

    what = "commpress.local.LocalSGD"

    def __init__(self, model: Any, optimizer: Any, sync_every: int = 8, *, process_group: Any = None,
                 verify_timeout: float = VERIFY_TIMEOUT_S, sync_timeout: float = SYNC_TIMEOUT_S,
                 replica_group: Any = None) -> None:
        super().__init__(model, optimizer, sync_every, process_group=process_group, verify_timeout=verify_timeout,
                         sync_timeout=sync_timeout, replica_group=replica_group)
        self.counters = CommStats()
        self._buffer = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        self.verify_ranks(f"LocalSGD(sync_every={self.sync_every}), {len(self.params)} parameters")

    def sync(self) -> Exception | None:
        """All-reduce the flat parameters and write the mean back into the module."""
        flat = self.flat_params(self._buffer)
        self.wait_sync(allreduce_mean(flat, group=self.process_group, stats=self.counters), self.syncs, self.step)
        if not bool(torch.isfinite(flat).all()):
            return FloatingPointError(f"{self.what}: the averaged parameters at inner step {self.step} are not finite "
                                      "(some rank diverged); every rank stops here")
        self.set_params(flat)
        return None

    def stats(self) -> dict[str, float]:
        """Inner steps, syncs and the bytes handed to the all-reduce."""
        return {"steps": self.step, "syncs": self.sync_index, "final_syncs": self.final_syncs,
                **self.counters.as_dict()}


__all__ = ["LocalSGD"]
