"""Python callbacks on collective futures, and the exit-time wait for the threads that free them.

Why: torch runs a future's Python callback on the thread that completes it (gloo's worker), and
that thread frees the callback afterwards, taking the GIL again to do so. The future's waiter
wakes before that free. When the waiter is the main thread on its way out (the last sync of a
run, a barrier, exit), the free can come after the interpreter began to finalize: the worker
then cannot take the GIL, Python ends the thread (``pthread_exit``), and its forced unwind through
torch's C++ frames aborts the process with "terminate called without an active exception"
(measured on torch 2.13 / Python 3.11 with a callback whose free takes 0.3 s: every run aborts; in
CI the gap is a worker thread descheduled on a loaded machine: one rank of a 2-rank benchmark).

So every callback commpress hands to torch goes through :func:`then` or :func:`add_done_callback`,
which count it from when it starts to run until torch has freed it, and an ``atexit`` hook
(atexit runs before finalization) waits, bounded by :data:`EXIT_WAIT_S`, until that count is 0.
A callback whose collective is still in flight at exit is not waited for: it may never run.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

#: the longest an exiting process waits for backend threads to free callbacks that already ran
EXIT_WAIT_S = 5.0
#: after the count reaches 0, the freeing thread still returns through a few bytecodes and C frames
#: holding the GIL: a short sleep without the GIL lets it finish
EXIT_GRACE_S = 0.05

_lock = threading.RLock()  # re-entrant: a collection inside the lock may free a callback (its __del__ takes it)
_all_freed = threading.Condition(_lock)
_running = 0  # callbacks that started to run and that torch has not freed yet
_used = False  # any callback ever ran: only then is the grace at exit worth its 50 ms


class _Counted:
    """``fn``, counted in :data:`_running` from its call until this wrapper (and what ``fn`` holds) is freed."""

    __slots__ = ("_fn", "_ran")

    def __init__(self, fn: Callable[[torch.futures.Future[Any]], Any]) -> None:
        self._fn: Callable[[torch.futures.Future[Any]], Any] | None = fn
        self._ran = False

    def __call__(self, fut: torch.futures.Future[Any]) -> Any:
        global _running, _used
        with _lock:
            if not self._ran:
                self._ran, _used = True, True
                _running += 1
        assert self._fn is not None
        return self._fn(fut)

    def __del__(self) -> None:
        global _running
        self._fn = None  # free the closure (its tensors, objects with finalizers) before counting this done
        if self._ran:
            try:
                with _lock:
                    _running -= 1
                    _all_freed.notify_all()
            except (AttributeError, TypeError):  # freed while the interpreter tears this module down: nothing waits
                pass


def then(fut: torch.futures.Future[Any], fn: Callable[[torch.futures.Future[Any]], Any]) -> torch.futures.Future[Any]:
    """``fut.then(fn)``, with ``fn`` counted until torch frees it (module docstring)."""
    return fut.then(_Counted(fn))


def add_done_callback(fut: torch.futures.Future[Any], fn: Callable[[torch.futures.Future[Any]], Any]) -> None:
    """``fut.add_done_callback(fn)``, with ``fn`` counted until torch frees it (module docstring)."""
    fut.add_done_callback(_Counted(fn))


def running() -> int:
    """How many callbacks have started and are not freed yet (0 when every backend thread is done with them)."""
    with _lock:
        return _running


@atexit.register
def wait_for_backend_threads(timeout: float = EXIT_WAIT_S) -> bool:
    """Wait (at most ``timeout`` s) until torch has freed every callback that ran; False if time ran out.

    Registered with :mod:`atexit`, so it runs before the interpreter finalizes; callable any time.
    """
    with _all_freed:
        done = _all_freed.wait_for(lambda: _running == 0, timeout)
        used = _used
    if used:
        time.sleep(EXIT_GRACE_S)
    return done


__all__ = ["EXIT_WAIT_S", "add_done_callback", "running", "then", "wait_for_backend_threads"]
