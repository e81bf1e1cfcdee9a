"""A failure on one rank is every rank's error: :class:`FaultChannel`, and the waits it bounds.

A rank that cannot decode what it received raises :class:`~commpress.errors.RankFailedError`
and posts it to the process group's store (:mod:`.store`); every other rank raises the same
error within a fraction of a second instead of waiting in a collective for the process group's timeout.
Adapters open a :meth:`FaultChannel.guarded` scope around their unit of work; :func:`then`,
:func:`wait` and :func:`current_scope` are what the driver and algorithms read of it.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import datetime
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ..errors import ConfigurationError, RankFailedError
from . import callbacks
from .store import group_name, tcp_store

logger = logging.getLogger("commpress")

#: (channel, position) of the collectives issued on this thread: see :meth:`FaultChannel.scope`.
_scope: contextvars.ContextVar[tuple[FaultChannel, str] | None] = contextvars.ContextVar(
    "commpress_fault_scope", default=None
)
#: a synchronous wait inside a fault scope checks for other ranks' failures this often (CPU)
WAIT_SLICE_S = 0.1
WAIT_SLICE = datetime.timedelta(seconds=WAIT_SLICE_S)
#: the watcher thread reads its wake key this often (one ~60 us store round trip), never blocking in
#: the store: a thread blocked there at interpreter exit aborts the process (FaultChannel.close)
WATCH_SLICE_S = 0.25
WATCH_SLICE = datetime.timedelta(seconds=WATCH_SLICE_S)
#: a key nobody writes: reading it tells whether a shared connection still reaches its store
_PROBE_KEY = "commpress/fault/probe"


class FaultChannel:
    """Makes one rank's failure every rank's error within a fraction of a second, at almost no cost while healthy.

    Why: a rank that cannot decode the bytes it received (corrupted on the way, a bug) raises
    there, and nothing tells the others: they go on to a collective the failing rank never joins
    and wait for the process group's timeout (gloo: 30 min by default); if the user catches the
    error and trains on, the ranks' models silently differ.

    How (one channel per process group and process, :meth:`of`):

    1. **post**, on the failing rank and only there (:meth:`fail`): rank, step, bucket and reason
       go into every rank's wake key in the process group's key-value store (the one
       ``init_process_group`` built: it stays up when collectives do not); the rank waits up to
       :attr:`ACK_TIMEOUT_S` for the others to read it (rank 0 hosts the store: exiting at once
       could take the message with it), then raises :class:`RankFailedError`;
    2. **notice**, on every rank: a daemon thread reads its own wake key every :data:`WATCH_SLICE_S`,
       over a connection of commpress's own (one ``TCPStore.clone()`` per store, shared by the
       channels on it: no store call of the user's or of torch's queues ahead of a read).
       That costs almost nothing while healthy: no store read per step (a read is a ~60 us round
       trip on loopback, measured), no extra collective; it never blocks in the store (a timed-out
       ``store.wait`` logs c10d warnings), so :meth:`close` can always stop it. When the key appears,
       the thread acknowledges it and waits (at most :attr:`ACK_TIMEOUT_S`) until every rank
       has, so that no rank raises, and perhaps exits, before all have read it (a peer whose
       collective breaks meanwhile waits for it, :meth:`_await_fault`); then it records the
       fault and fails every pending future commpress handed out
       (:meth:`then`); a synchronous wait (:meth:`wait`) notices within :data:`WAIT_SLICE_S`
       (CPU; on CUDA, NCCL's own watchdog bounds the wait: not measured here);
    3. **stay failed**: every later step raises at once (:meth:`check`), on the failing rank too,
       so catching the error and training on cannot leave the ranks silently apart.

    The collective the failing rank never joins stays pending in gloo until that rank exits or
    the process group's timeout: gloo's ``abort()`` / ``shutdown()`` in torch 2.13 neither close
    its connections nor release a pending collective (measured), but nothing waits for it.
    Limits: a rank blocked in a collective commpress did not issue (DDP's buffer broadcast, your
    own ``all_reduce``) waits for that collective's own failure (the channel logs the error at
    once); with a store other than TCPStore (FileStore, HashStore) failures stay local.
    """

    #: seconds the failing rank waits for the others to read its message before it raises
    ACK_TIMEOUT_S = 2.0
    #: (host, port, group name) -> channel; a channel whose store went away is replaced
    _channels: ClassVar[dict[tuple[str, int, str], FaultChannel]] = {}
    #: (host, port) -> the one connection (a ``TCPStore.clone()``) every channel on that store shares:
    #: a clone costs a new connection, and every ~13th took 5.0 s here (torch 2.13), so one per group
    #: (DiLoCo over FSDP opens ~20 groups) added seconds to start-up; TCPStore serialises its calls
    _connections: ClassVar[dict[tuple[str, int], Any]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, group: Any, connection: Any = None) -> None:
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._prefix = f"commpress/fault/{group_name(group)}/"
        self._lock = threading.Lock()
        self._fault: tuple[int, str, str] | None = None  # known to every rank (or the acks timed out)
        self._claim: tuple[int, str, str] | None = None  # this rank's own failure, being posted
        self._known = threading.Event()  # set with _fault
        self._pending: dict[int, torch.futures.Future[Any]] = {}
        self._client: Any = None  # posts and acks (the shared connection; None: nothing to post to)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()  # set by close(): the watcher returns at once
        if connection is None or self.world < 2:
            return
        self._client = connection
        self._thread = threading.Thread(target=self._watch, args=(connection,), name="commpress-faults", daemon=True)
        self._thread.start()

    @classmethod
    def of(cls, group: Any) -> FaultChannel:
        """The channel of ``group`` in this process (its thread started on first use)."""
        store = tcp_store(group)
        if store is None:
            return cls(group)
        key = (str(store.host), int(store.port), group_name(group))
        with cls._registry_lock:
            channel = cls._channels.get(key)
            if channel is None or channel._thread is None or not channel._thread.is_alive():
                channel = cls._channels[key] = cls(group, cls._connection(store, key[:2]))
        return channel

    @classmethod
    def _connection(cls, store: Any, address: tuple[str, int]) -> Any:
        """The shared connection to ``store`` (registry lock held): reused while it answers, else a new clone; None if none can be made."""
        conn = cls._connections.get(address)
        if conn is not None:
            try:
                conn.check([_PROBE_KEY])  # one round trip: a store destroyed and made again on this port needs a new one
                return conn
            except Exception:  # noqa: BLE001 - the store it reached is gone
                del cls._connections[address]
        try:
            conn = store.clone()
        except RuntimeError as exc:
            logger.info("commpress: no fault channel (%s): a failure stays on the rank that saw it", exc)
            return None
        with contextlib.suppress(Exception):  # bounds each read: a store that stops answering cannot hold a watcher
            conn.set_timeout(2 * WATCH_SLICE)
        cls._connections[address] = conn
        return conn

    def _key(self, kind: str, rank: int) -> str:
        return f"{self._prefix}{kind}/{rank}"

    def _error(self) -> RankFailedError:
        assert self._fault is not None
        return RankFailedError(*self._fault)

    # ----- used by adapters and algorithms ----------------------------------------------------
    @contextlib.contextmanager
    def scope(self, where: str) -> Iterator[None]:
        """Collectives issued inside belong to this channel; ``where`` names them in errors.

        Algorithms read the scope when they start (:class:`StepContext`), so the futures and
        waits they hand out can be failed by this channel, and their failures are posted.
        """
        token = _scope.set((self, where))
        try:
            yield
        finally:
            _scope.reset(token)

    @contextlib.contextmanager
    def guarded(self, where: str) -> Iterator[None]:
        """An adapter's unit of work at ``where``: :meth:`check`, then run it in :meth:`scope`.

        An exception inside means this rank cannot go on and the others must not wait for it: it
        is posted (:meth:`fail`) and the error that returns is raised in its place.
        """
        self.check()  # some rank already failed: raise at once, issue nothing
        with self.scope(where):
            try:
                yield
            except Exception as exc:
                raise self.fail(exc, where) from exc

    def check(self) -> None:
        """Raise :class:`RankFailedError` if any rank of the group failed."""
        if self._fault is not None:
            raise self._error()

    def fail(self, exc: BaseException, where: str) -> BaseException:
        """Report that this rank failed at ``where`` with ``exc`` to every rank; return the error to raise.

        Errors every rank raises anyway (:class:`~commpress.errors.ConfigurationError`) and
        failures of a collective itself (a peer that died: not this rank's fault) come back
        unchanged, or as the failure another rank already posted.
        """
        if isinstance(exc, (RankFailedError, ConfigurationError)):
            return exc
        if getattr(exc, "_commpress_collective", False) or not isinstance(exc, ValueError):
            # a collective broke, or torch raised: maybe because another rank failed and exited
            if self._await_fault():
                return self._error()
            if getattr(exc, "_commpress_collective", False):
                return exc
        with self._lock:
            first = self._fault is None and self._claim is None
            if first:
                self._claim = (self.rank, where, f"{type(exc).__name__}: {exc}")
        if first:
            assert self._claim is not None
            logger.error("%s", RankFailedError(*self._claim))
            self._post(self._claim)
            self._record(self._claim)
        else:
            self._known.wait(2 * self.ACK_TIMEOUT_S)
        return self._error() if self._fault is not None else RankFailedError(*(self._claim or (self.rank, where, str(exc))))

    def _await_fault(self) -> bool:
        """After a collective broke: wait (at most :attr:`ACK_TIMEOUT_S`) for a failure in flight.

        A rank learns of a failure only once every rank's watcher has read it (see
        :meth:`_watch`), so a peer that raises and exits cannot take the message with it; this
        covers the moments between. A failure path only: a healthy step never gets here.
        """
        if self._fault is None and self._thread is not None and self._thread.is_alive():
            self._known.wait(self.ACK_TIMEOUT_S)
        return self._fault is not None

    def then(self, fut: torch.futures.Future[Any], fn: Callable[[torch.futures.Future[Any]], Any]) -> torch.futures.Future[Any]:
        """``fut.then(fn)`` for CPU tensors, except that the result also fails as soon as any rank failed.

        The result is a ``then`` child of a future this channel completes: DDP waits for it in
        C++, where only a failed callback (not ``Future.set_exception``) reads as an error.
        """
        trigger: torch.futures.Future[Any] = torch.futures.Future()
        key = id(trigger)
        with self._lock:
            added = self._fault is None
            if added:
                self._pending[key] = trigger
        if not added:
            trigger.set_exception(self._error())
            return callbacks.then(trigger, _value)

        def complete(f: torch.futures.Future[Any]) -> None:
            with self._lock:  # whoever takes it from _pending completes it
                if self._pending.pop(key, None) is None:
                    return
            try:
                value = fn(f)
            except Exception as exc:  # noqa: BLE001 - handed on through the future
                trigger.set_exception(self._error() if self._await_fault() else exc)
                return
            trigger.set_result(value)

        callbacks.add_done_callback(fut, complete)
        return callbacks.then(trigger, _value)

    def wait(self, work: Any, device: torch.device) -> None:
        """``work.wait()`` that raises :class:`RankFailedError` within :data:`WAIT_SLICE_S` of any rank failing.

        On CPU (gloo) it waits in slices (``work.wait(timeout)``: a slice that runs out leaves the
        collective running, measured on torch 2.13) and checks for a failure between them;
        a collective that completes within the first slice costs what ``work.wait()`` costs.
        Elsewhere (NCCL) a timed wait may abort the communicator: plain ``wait``, then the check.
        """
        if self._thread is not None and device.type == "cpu":
            while True:
                try:
                    work.wait(WAIT_SLICE)
                    return
                except RuntimeError:
                    if work.is_completed():
                        break  # it failed, or completed just now: the plain wait below tells which
                    self.check()
        try:
            wait_collective(work)
        except RuntimeError as exc:
            if self._await_fault():
                raise self._error() from exc
            raise
        self.check()

    # ----- the failing rank, and the watcher ----------------------------------------------------
    def _post(self, fault: tuple[int, str, str]) -> None:
        if self._client is None:
            return
        message = json.dumps(dict(zip(("rank", "where", "reason"), fault)))
        try:
            self._client.multi_set([self._key("wake", r) for r in range(self.world)], [message] * self.world)
            others = [self._key("ack", r) for r in range(self.world) if r != self.rank]
            self._client.wait(others, datetime.timedelta(seconds=self.ACK_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - a rank that is gone, or slow: it learns what it can
            logger.warning("commpress: not every rank acknowledged the failure (%s)", exc)

    def _record(self, fault: tuple[int, str, str]) -> None:
        """Make ``fault`` this rank's error: every later check raises it, pending futures fail."""
        with self._lock:
            first = self._fault is None
            if first:
                self._fault = fault
        self._known.set()
        if first:
            self._release()

    def _release(self) -> None:
        """Fail every pending future (the fault is set)."""
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for fut in pending:
            fut.set_exception(self._error())

    def _watch(self, watcher: Any) -> None:
        key = self._key("wake", self.rank)
        while True:
            try:
                if watcher.check([key]):  # a non-blocking read: a timed-out store wait logs two c10d warnings
                    value = watcher.get(key).decode()
                    break
            except Exception:  # noqa: BLE001 - the store went away (its host exited): nothing more to watch
                return
            if self._stop.wait(WATCH_SLICE_S):
                return
        try:
            info = json.loads(value)
            fault = (int(info["rank"]), str(info["where"]), str(info["reason"]))
        except (ValueError, KeyError, TypeError):
            logger.warning("commpress: unreadable failure message %r", value[:200])
            return
        # raise nowhere until every rank has read it: rank 0 hosts the store, and a rank that
        # raises may exit (a peer whose collective then breaks finds the failure in _await_fault)
        with contextlib.suppress(Exception):
            watcher.set(self._key("ack", self.rank), "1")
            watcher.wait([self._key("ack", r) for r in range(self.world)], datetime.timedelta(seconds=self.ACK_TIMEOUT_S))
        if self._fault is None:
            logger.error("%s", RankFailedError(*fault))
        self._record(fault)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the watcher thread (at exit); wait for it at most ``timeout`` seconds.

        The thread must be gone before the interpreter finalizes: one still blocked in
        ``store.wait`` then dies in C++ when the wait returns (``take_gil`` exits the thread,
        whose forced unwind aborts the process: measured, 4 of 12 four-rank runs whose rank 0,
        the store's host, went first). The watcher never blocks in the store (it reads its key
        and sleeps on the stop flag), so it returns at once, or after a read that a store no
        longer answering ends within its request timeout (two slices; longer on a starved CPU:
        hence the generous wait).
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)


@atexit.register
def _close_channels() -> None:
    """Stop every watcher before the interpreter finalizes: all asked at once, then joined against one deadline."""
    channels = list(FaultChannel._channels.values())
    for channel in channels:
        channel._stop.set()  # every watcher returns at once, or after its current store read
    deadline = time.monotonic() + 10.0
    for channel in channels:
        channel.close(timeout=max(0.0, deadline - time.monotonic()))


def _value(fut: torch.futures.Future[Any]) -> Any:
    return fut.value()  # raises the stored exception inside a callback: a failed future in C++


def wait_collective(work: Any) -> None:
    """``work.wait()``; its failure is tagged as the collective's (a peer's), not this rank's."""
    try:
        work.wait()
    except Exception as exc:
        exc._commpress_collective = True  # type: ignore[attr-defined]
        raise


def then(
    fut: torch.futures.Future[Any], fn: Callable[[torch.futures.Future[Any]], Any], device: torch.device,
    scope: tuple[FaultChannel, str] | None = None,
) -> torch.futures.Future[Any]:
    """``fut.then(fn)``; inside a fault scope (``scope``, default the current one) its channel can fail it.

    CPU only: on CUDA (NCCL) the plain ``then`` keeps its stream semantics, and a rank notices
    another's failure at its next bucket (:meth:`FaultChannel.check`) or through NCCL's watchdog.
    """
    scope = scope or _scope.get()
    if scope is None or scope[0]._thread is None or device.type != "cpu":
        return callbacks.then(fut, fn)
    return scope[0].then(fut, fn)


def wait(work: Any, device: torch.device | str = "cpu") -> None:
    """Wait for an async collective on ``device``; inside a :meth:`FaultChannel.scope`, bounded by it."""
    scope = _scope.get()
    if scope is None:
        wait_collective(work)
    else:
        scope[0].wait(work, torch.device(device))


def current_scope() -> tuple[FaultChannel, str] | None:
    """The (channel, position) of the :meth:`FaultChannel.scope` this thread is in, or None."""
    return _scope.get()


__all__ = ["WAIT_SLICE_S", "FaultChannel", "current_scope", "then", "wait", "wait_collective"]
