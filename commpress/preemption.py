"""Preemption: on SIGTERM to any rank, every rank finishes the same step, saves and exits.

Cloud schedulers (Kubernetes, Slurm, spot instances) send SIGTERM and allow a grace period
before SIGKILL. Without a handler the process dies at once and the state that lives only in
memory is lost; for commpress that is every rank's error-feedback residuals and velocities,
which a restart from the last periodic checkpoint cannot recover.
:func:`install_preemption_handler` returns a :class:`PreemptionHandler` that turns the signal
into a clean stop:

1. **the signal handler only sets a flag** (no I/O, no lock, no store call: it may run in
   the middle of anything the main thread does, a store call included); a second signal, for
   example during the save, sets the same flag and changes nothing;
2. **at the end of the next step** (the optimizer's step post-hook, or :meth:`PreemptionHandler.step_done`)
   the signalled rank writes a stop step into the process group's key-value store (the c10d
   store ``init_process_group`` built), first writer wins (``compare_set``), so ranks
   signalled together agree on one value;
3. **every rank reads the store** every ``check_every`` steps (``store.check``: one non-blocking
   round trip, ~20-190 us on loopback TCPStore, measured; no collective on the training stream);
4. **after the stop step** every rank calls your ``save(step)``, waits (through the store) until
   every rank has saved, and exits with ``exit_code`` (143 by default).

Why the store and not a collective: a one-float ``all_reduce`` per step costs ~500 us on
2-rank gloo on loopback (measured, ~320 us with a FileStore rendezvous) and is a
synchronisation point every step; a store check is local to each rank and is done before the
next step's collectives.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

logger = logging.getLogger("commpress")

#: 128 + SIGTERM, what a shell reports for a process SIGTERM ended: schedulers read it as
#: "terminated, may be retried"; torchrun restarts the workers on any non-zero exit while
#: ``--max-restarts`` allows. Kubernetes and Slurm requeue on a non-zero code by their own policy.
EXIT_CODE = 143
#: seconds each rank waits for the other ranks' ``save`` to finish before it exits anyway
SAVE_TIMEOUT_S = 300.0
_AUTO = "auto"
#: ``optimizer=`` of :class:`PreemptionHandler`: count the steps of the first optimizer that steps
FIRST_TO_STEP = "first-to-step"


class SignalFlag:
    """Handlers for ``signals`` that only record the first one received, and put back the old ones.

    A handler may run in the middle of anything the main thread does (a store call, an MPI
    call), so it does no I/O and takes no lock: the flag is read between steps by whoever owns
    it. ``SA_RESTART`` semantics (``siginterrupt(sig, False)``): a system call it lands in resumes.

    Args:
        signals: the signals to catch.
        off_main_thread: outside the main thread, where Python cannot install handlers, log this
            line and catch nothing; None (default) raises there as :func:`signal.signal` does.
    """

    def __init__(self, signals: Sequence[int], *, off_main_thread: str | None = None) -> None:
        #: the first signal received, or None
        self.signalled: int | None = None
        self._previous: dict[int, Any] = {}
        if off_main_thread is not None and threading.current_thread() is not threading.main_thread():
            logger.info(off_main_thread)
            return
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self.set)
            signal.siginterrupt(sig, False)

    def set(self, signum: int, frame: FrameType | None = None) -> None:
        """The handler: record ``signum`` unless a signal came before it."""
        if self.signalled is None:
            self.signalled = signum

    def restore(self) -> None:
        """Put back the handlers that were installed before (idempotent)."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


def stop_step(posted_at: int, check_every: int = 1) -> int:
    """The step after which every rank stops, when a rank posts the stop at the end of ``posted_at``.

    Bound: in DDP, finishing step ``s`` needs every rank's part of step ``s``'s all-reduce, and no
    rank can finish step ``s + 1`` before the posting rank joins step ``s + 1``'s all-reduce, which
    it does only after the (synchronous, round-trip) store write. So when the stop is posted, every
    peer has finished step ``s - 1`` or ``s``, and every peer reads the key at its next check, at
    the latest at ``m``, the first multiple of ``check_every`` after ``s``. Stopping after
    ``max(s + 2, m + 1)`` means every rank knows the stop step one step *before* it: no rank needs
    the store at the stop step itself, when rank 0 (which hosts a TCPStore) may already have saved
    and exited. ``+1`` would be enough for agreement alone; the extra step costs one step of the
    grace period and buys that.

    Args:
        posted_at: the step count at which the signalled rank posts (its completed steps).
        check_every: how often (in steps) each rank reads the store.

    Returns:
        The step count after which every rank saves and stops.
    """
    next_check = (posted_at // check_every + 1) * check_every
    return max(posted_at + 2, next_check + 1)


class PreemptionHandler:
    """Turns SIGTERM on any rank into one agreed stop step, a save on every rank, and a restartable exit.

    Contract: the handler counts steps (the optimizer's step post-hook, or your calls to
    :meth:`step_done` when ``optimizer=None``). After the agreed stop step it calls
    ``save(step)`` on every rank (``step``: steps completed, ``start_step`` included, so a
    restart resumes with ``range(step, total)``), waits until every rank's ``save`` has returned
    (so that a launcher that kills the remaining ranks once one exits cannot cut a save short),
    then ends the process with ``os._exit(exit_code)`` after flushing stdout, stderr and the
    logging handlers. ``os._exit`` rather than ``sys.exit``: a ``SystemExit`` raised inside
    ``optimizer.step()`` unwinds your loop into the process group's teardown, which can abort
    (SIGABRT, exit code 134) or wait for a peer that has already gone; the saved files are
    fsynced by then. ``exit_code=None`` does not exit: :meth:`step_done` returns True and
    :attr:`stopped` is set, and your loop breaks.

    Steps skipped by ``GradScaler`` (no ``optimizer.step()``) are not counted, on every rank
    alike. If training ends before the stop step, nothing is saved by the handler.

    Args:
        save: ``save(step)``, your checkpoint: model, optimizer and each rank's commpress state
            (``state.save(f"ckpt/commpress-rank{rank}.cpst")``: atomic, so a SIGKILL at the end
            of the grace period leaves the previous file or the new one, never half a file).
        group: the process group whose ranks stop together (default: the world).
        signals: the signals that request the stop (installed in the main thread).
        exit_code: the process's exit status after the save (None: do not exit).
        check_every: read the store every this many steps (1: every step).
        optimizer: the optimizer whose ``step()`` ends a step (a step post-hook is registered);
            :data:`FIRST_TO_STEP`: the first optimizer that steps after this handler is built (a
            global step post-hook, :func:`torch.optim.optimizer.register_optimizer_step_post_hook`;
            later steps of other optimizers are not counted); or None to call :meth:`step_done`
            yourself.
        start_step: steps already done before this handler (after a resume).
        store: the c10d store to agree through (default: the process group's).
        save_timeout: seconds to wait for the other ranks' saves before exiting anyway.
    """

    def __init__(
        self,
        save: Callable[[int], Any],
        *,
        group: Any = None,
        signals: Sequence[int] = (signal.SIGTERM,),
        exit_code: int | None = EXIT_CODE,
        check_every: int = 1,
        optimizer: torch.optim.Optimizer | str | None = None,
        start_step: int = 0,
        store: Any = None,
        save_timeout: float = SAVE_TIMEOUT_S,
    ) -> None:
        if not callable(save):
            raise TypeError(f"save must be callable as save(step), got {type(save).__name__}")
        if isinstance(optimizer, str) and optimizer != FIRST_TO_STEP:
            raise ValueError(f"optimizer must be an Optimizer, None or {FIRST_TO_STEP!r}, got {optimizer!r}")
        if not isinstance(check_every, int) or check_every < 1:
            raise ValueError(f"check_every must be a positive int, got {check_every!r}")
        if exit_code is not None and not (isinstance(exit_code, int) and 0 <= exit_code <= 255):
            raise ValueError(f"exit_code must be an int in [0, 255] or None, got {exit_code!r}")
        self.save = save
        self.exit_code = exit_code
        self.check_every = check_every
        self.save_timeout = float(save_timeout)
        #: steps completed (``start_step`` included)
        self.step = int(start_step)
        #: True once this rank has saved at the stop step
        self.stopped = False
        self._stop: int | None = None
        distributed = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if distributed else 1
        self.rank = dist.get_rank(group) if distributed else 0
        self._store = store
        if self.world > 1 and store is None:
            from .comm.store import store_of
            self._store = store_of(group)
            if self._store is None:
                raise RuntimeError("preemption: this torch does not expose the process group's store; pass store=")
        if self.world > 1:
            from .comm.store import group_name
            # a fresh key per torchrun restart: the agent's store may outlive the workers
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            self._key = f"commpress/preempt/{group_name(group)}/{attempt}"
        else:
            self._key = "commpress/preempt"
        self._flag = SignalFlag(signals)
        self._counted: weakref.ref[torch.optim.Optimizer] | None = None
        self._hook: RemovableHandle | None = None
        if optimizer == FIRST_TO_STEP:
            self._hook = register_optimizer_step_post_hook(self._after_first_to_step)
        elif optimizer is not None and not isinstance(optimizer, str):
            self._hook = optimizer.register_step_post_hook(self._after_step)

    # ----- the signal handler: a flag, nothing else ------------------------------------------
    @property
    def signalled(self) -> int | None:
        """The first signal this rank received, or None (set by the signal handler, nothing else)."""
        return self._flag.signalled

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._flag.set(signum, frame)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.step_done()

    def _after_first_to_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._counted is None:
            self._counted = weakref.ref(optimizer)
            logger.info("commpress: preemption: counting the steps of %s (the first optimizer to step)",
                        type(optimizer).__name__)
        if self._counted() is optimizer:
            self.step_done()

    # ----- at the end of each step ------------------------------------------------------------
    @property
    def stop_step(self) -> int | None:
        """The agreed step after which every rank stops, once this rank knows it (else None)."""
        return self._stop

    def step_done(self) -> bool:
        """Count one finished step; at the agreed stop step, save (and exit, see the class).

        Call it after ``optimizer.step()`` when the handler was built with ``optimizer=None``
        (with an optimizer, its step post-hook calls it: do not call it as well).

        Returns:
            True once this rank has saved at the stop step (only when ``exit_code`` is None:
            otherwise the process has exited); False while training goes on.
        """
        if self.stopped:
            return True
        self.step += 1
        if self._stop is None:
            if self.signalled is not None:
                self._post()
            elif self.world > 1 and self.step % self.check_every == 0 and self._store.check([self._key]):
                self._stop = int(self._store.get(self._key))
                logger.warning("commpress: preemption requested by another rank: stopping after step %d", self._stop)
        if self._stop is None or self.step < self._stop:
            return False
        if self.step > self._stop:  # the bound above rules it out; save what there is rather than nothing
            logger.error("commpress: stop step %d already passed (step %d): saving now", self._stop, self.step)
        self._finish()
        return True

    def _post(self) -> None:
        if self.world == 1:
            self._stop = self.step
        else:
            # compare_set: the first rank to post wins; it returns the stored value (a round trip,
            # so the key is in the store before this rank's next collective)
            want = stop_step(self.step, self.check_every)
            self._stop = int(self._store.compare_set(self._key, "", str(want)))
        logger.warning(
            "commpress: signal %d on rank %d at step %d: every rank stops after step %d, saves and exits",
            self.signalled, self.rank, self.step, self._stop,
        )

    def _finish(self) -> None:
        self.save(self.step)
        self._wait_for_saves()
        self.stopped = True
        if self.exit_code is None:
            return
        logger.warning("commpress: saved at step %d, exiting with code %d", self.step, self.exit_code)
        for handler in logging.getLogger().handlers + logger.handlers:
            handler.flush()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(self.exit_code)

    def _wait_for_saves(self) -> None:
        """Every rank's ``save`` has returned (a counter in the store), or ``save_timeout`` passed."""
        if self.world == 1:
            return
        key = f"{self._key}/saved"
        deadline = time.monotonic() + self.save_timeout
        try:
            done = self._store.add(key, 1)
            while done < self.world:
                if time.monotonic() > deadline:
                    logger.error("commpress: %d of %d ranks saved within %.0f s", done, self.world, self.save_timeout)
                    return
                time.sleep(0.01)
                done = self._store.add(key, 0)
        except (RuntimeError, OSError) as exc:
            # the store's host (rank 0) exits as soon as it has seen every rank's save: done
            logger.info("commpress: store gone while waiting for the other ranks' saves (%s)", exc)

    def close(self) -> None:
        """Restore the previous signal handlers and remove the optimizer hook."""
        self._flag.restore()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def __repr__(self) -> str:
        return (
            f"PreemptionHandler(rank={self.rank}, step={self.step}, signalled={self.signalled}, "
            f"stop_step={self._stop}, exit_code={self.exit_code})"
        )


def install_preemption_handler(
    state: Any,
    save: Callable[[int], Any],
    *,
    signals: Sequence[int] = (signal.SIGTERM,),
    exit_code: int | None = EXIT_CODE,
    check_every: int = 1,
    optimizer: torch.optim.Optimizer | str | None = _AUTO,
    start_step: int = 0,
    save_timeout: float = SAVE_TIMEOUT_S,
) -> PreemptionHandler:
    """Stop every rank after one agreed step when any rank gets SIGTERM: ``save(step)``, then exit.

    Call it on every rank, in the main thread, after ``commpress.ddp.register`` (and after
    loading a checkpoint); see :class:`PreemptionHandler` for the contract and :func:`stop_step`
    for the agreement.

    Args:
        state: the commpress state (:class:`~commpress.ddp.CompressionState`): its process group
            and the optimizer it was registered with are used; None: the world, and pass
            ``optimizer``.
        save: ``save(step)``, called on every rank after the stop step.
        signals: the signals that request the stop.
        exit_code: the exit status after the save (default 143 = 128 + SIGTERM; None: no exit,
            :meth:`PreemptionHandler.step_done` returns True and your loop breaks).
        check_every: read the store every this many steps.
        optimizer: ``"auto"`` (default): the optimizer ``state`` was registered with
            (``optimizer=opt``) or has found, else the first optimizer that steps
            (:data:`FIRST_TO_STEP`: a state registered without ``optimizer=`` finds the user's
            only at its first step); an optimizer; or None to call
            :meth:`PreemptionHandler.step_done` after each step yourself.
        start_step: steps already done (after a resume): ``save`` receives the total.
        save_timeout: seconds to wait for the other ranks' saves before exiting anyway.

    Returns:
        The installed :class:`PreemptionHandler`.

    Example::

        state = commpress.ddp.register(ddp_model, "topk", ratio=0.01, optimizer=opt)
        def save(step):
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, f"ckpt{rank}.pt")
            state.save(f"commpress-rank{rank}.cpst")
        commpress.install_preemption_handler(state, save)
    """
    if isinstance(optimizer, str):
        if optimizer != _AUTO:
            raise ValueError(f"optimizer must be an Optimizer, None or {_AUTO!r}, got {optimizer!r}")
        optimizer = getattr(state, "optimizer", None) or FIRST_TO_STEP
    return PreemptionHandler(
        save, group=getattr(state, "process_group", None), signals=signals, exit_code=exit_code,
        check_every=check_every, optimizer=optimizer, start_step=start_step, save_timeout=save_timeout,
    )


def init_restartable_process_group(backend: str = "gloo", *, timeout: datetime.timedelta | None = None,
                                   **kwargs: Any) -> None:
    """``dist.init_process_group(backend)`` that also works in a torchrun restart (``--max-restarts``).

    torch 2.13's torchrun keeps one TCPStore for every restart of a job, and the process group's
    rendezvous keys of the killed attempt are still in it: a plain ``init_process_group("gloo")``
    in the restarted workers reads the dead workers' addresses and fails (measured, without
    commpress: ``Gloo connectFullMesh failed ... Connection refused`` on both restarts, or a
    302 s wait for ``Connect timeout``). This builds the process group on the same ``env://`` store under
    a prefix of its own per attempt (``TORCHELASTIC_RESTART_COUNT``), which avoids it; outside
    torchrun the prefix is ``attempt-0`` and nothing else changes.

    Args:
        backend: the process group's backend (``"gloo"``, ``"nccl"``).
        timeout: the store's and the collectives' timeout (default: torch's).
        **kwargs: passed on to ``dist.init_process_group`` (``device_id``, ``pg_options``, ...).
    """
    for key in ("store", "init_method", "rank", "world_size"):
        if key in kwargs:
            raise ValueError(f"init_restartable_process_group reads {key} from torchrun's environment; do not pass it")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if timeout is None:
        store, rank, world = next(dist.rendezvous("env://"))
    else:
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        store.set_timeout(timeout)
        kwargs["timeout"] = timeout
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt-{attempt}", store), rank=rank,
                            world_size=world, **kwargs)


__all__ = ["EXIT_CODE", "PreemptionHandler", "SignalFlag", "init_restartable_process_group", "install_preemption_handler", "stop_step"]
