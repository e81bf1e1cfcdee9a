"""Preemption in the parameter server: SIGTERM on any rank ends the run at one agreed step.

Schedulers send SIGTERM (``mpirun`` forwards it to every rank) and allow a grace period. A PS
rank that gets it must not just die: the workers' error-feedback residuals and the servers'
shards and optimizer state live only in memory. The stop works like the DDP one
(:mod:`commpress.preemption`), over MPI instead of a store:

1. the signal handler only sets a flag;
2. the loops (:func:`commpress.ps.mpi_loop.serve` / ``work``) call :meth:`StopAgreement.poll`
   between messages; a signalled rank other than 0 sends a STOP request to rank 0 (one int64,
   ``Isend`` on a duplicate of the run's communicator, tag :data:`TAG_REQUEST`);
3. rank 0 (server 0) picks the stop step ``S = max(its step, the workers' clocks) + 2`` and
   sends it to every other rank (tag :data:`TAG_STOP`). Every worker pulls from server 0 at
   every step, so no worker can be past server 0's clock + 1 when it picks ``S``: every worker
   reaches ``S`` and none has passed it;
4. every rank treats ``S`` as the run's last step: workers push up to ``S - 1``, checkpoint at
   ``S`` (if the run has a checkpoint directory) and say goodbye; servers checkpoint at ``S``;
   the run then ends as a shortened run does (the final shards still reach rank 0), and
   ``python -m commpress.ps`` exits with :data:`commpress.preemption.EXIT_CODE` (143).

``--resume`` then continues from ``S`` (bit for bit in sync mode, as every resume). Without a
checkpoint directory nothing is saved; a warning says so.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..preemption import SignalFlag
from .transport import mpi

logger = logging.getLogger("commpress")

TAG_REQUEST = 7021  #: a signalled rank -> rank 0: "stop, please"
TAG_STOP = 7022  #: rank 0 -> every other rank: the stop step
#: steps past the furthest step rank 0 knows: a worker can be at most one step past server 0's clock
MARGIN = 2


class StopAgreement:
    """The signal flag and the MPI exchange that turn it into one stop step on every rank.

    Build it on every rank of the run (the communicator is duplicated: a collective). Call
    :meth:`poll` often (it never blocks); it returns the agreed stop step once this rank knows
    it, else None. :meth:`close` restores the previous signal handlers.

    Args:
        comm: the run's communicator (rank 0 is server 0).
        signals: the signals that request the stop (handlers installed only in the main thread;
            elsewhere the run cannot be preempted and a log line says so).
    """

    def __init__(self, comm: Any, signals: Sequence[int] = (signal.SIGTERM,)) -> None:
        self.comm = comm.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        #: the agreed stop step once known
        self.stop_step: int | None = None
        self._requested = False
        self._sends: list[tuple[Any, np.ndarray]] = []
        self._flag = SignalFlag(
            signals, off_main_thread="commpress.ps: not in the main thread: SIGTERM is not turned into a clean stop")

    @property
    def signalled(self) -> int | None:
        """The first signal this rank received, or None (set by the handler, nothing else)."""
        return self._flag.signalled

    def _send(self, value: int, dest: int, tag: int) -> None:
        buf = np.array([value], dtype=np.int64)
        self._sends.append((self.comm.Isend([buf, mpi().INT64_T], dest=dest, tag=tag), buf))

    def _receive(self, source: int, tag: int) -> int:
        buf = np.empty(1, dtype=np.int64)
        self.comm.Recv([buf, mpi().INT64_T], source=source, tag=tag)
        return int(buf[0])

    def poll(self, known_step: int) -> int | None:
        """The agreed stop step, or None; ``known_step``: rank 0's furthest step (server 0's view)."""
        if self.stop_step is not None:
            return self.stop_step
        if self.signalled is not None and not self._requested:
            self._requested = True
            logger.warning("[commpress.ps rank %d] got signal %d: asking every rank to stop and save",
                           self.rank, self.signalled)
            if self.rank != 0:
                self._send(1, 0, TAG_REQUEST)
        if self.rank == 0:
            status = mpi().Status()
            while self.comm.Iprobe(source=mpi().ANY_SOURCE, tag=TAG_REQUEST, status=status):
                self._receive(status.Get_source(), TAG_REQUEST)
                self._requested = True
            if self._requested:
                self.stop_step = known_step + MARGIN
                for dest in range(1, self.size):
                    self._send(self.stop_step, dest, TAG_STOP)
        elif self.comm.Iprobe(source=0, tag=TAG_STOP):
            self.stop_step = self._receive(0, TAG_STOP)
        if self.stop_step is not None:
            logger.warning("[commpress.ps rank %d] stopping after step %d (preempted)", self.rank, self.stop_step)
        return self.stop_step

    def close(self) -> None:
        """Restore the previous signal handlers; finish this rank's sends and drop late requests.

        Nothing collective: ranks end a run in different ways (a dropped worker, a failed peer),
        and one that never joined a barrier would hang the others. The duplicate communicator is
        left to MPI's finalisation (one per run).
        """
        self._flag.restore()
        deadline = time.monotonic() + 1.0
        for req, _ in self._sends:  # one int64 each: sent eagerly; a peer that is gone must not block us
            while not req.Test() and time.monotonic() < deadline:
                time.sleep(0.001)
        self._sends.clear()
        if self.rank == 0:  # requests that came after the decision (several ranks signalled)
            status = mpi().Status()
            while self.comm.Iprobe(source=mpi().ANY_SOURCE, tag=TAG_REQUEST, status=status):
                self._receive(status.Get_source(), TAG_REQUEST)


__all__ = ["MARGIN", "StopAgreement", "TAG_REQUEST", "TAG_STOP"]
