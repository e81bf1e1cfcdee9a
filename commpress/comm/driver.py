"""The one driver every collective algorithm runs on.

An algorithm reduces one flat gradient buffer (a DDP bucket, or any 1-D tensor) cut into
:class:`Slot` s, one per tensor. What every algorithm needs is done here, once:

- the slots are checked to tile the buffer;
- accounting (:class:`CommStats`: bytes handed to collectives and estimated on the wire, next to
  what a plain all-reduce would cost) and timing (encode, decode, wait);
- **the non-finite policy.** :meth:`StepContext.compress` encodes a slot through its error
  feedback, first saving the residual; a slot whose input is not finite (or whose encode
  overflows) yields None, and the algorithm carries a flag instead of a packet. Every rank sees
  the same flags after the collective, so :meth:`StepContext.finish` writes NaN into that slot on
  every rank (``GradScaler`` then skips the step everywhere) and restores the residuals saved
  before this step: a voided step leaves no trace in anyone's error feedback;
- **one ordered issue path.** Algorithms issue every collective from the calling thread, in call
  order; the future :meth:`StepContext.finish` returns only decodes (a ``then`` callback never
  issues a collective: PyTorch's PowerSGD hook does, and gloo then aborts with several buckets);
- **a failure on one rank reaches every rank** (:class:`FaultChannel`): a rank that cannot decode
  what it received raises :class:`RankFailedError` and posts it to the process group's store;
  every other rank raises the same error within milliseconds instead of waiting in a collective
  for the process group's timeout.

An :class:`Algorithm` declares the codecs it runs, the residual layout it needs (one residual
per parameter, or per piece of one) and its phases (:meth:`Algorithm.launch`).
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import datetime
import json
import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ..codecs import Codec, NoneCodec
from ..codecs.base import all_finite
from ..errors import CodecError, ConfigurationError, RankFailedError
from ..feedback import ErrorFeedback
from ..wire.packet import Packet

logger = logging.getLogger("commpress")

# ``all_gather_single`` replaces the deprecated ``all_gather_into_tensor`` (same semantics).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_single(output: torch.Tensor, input: torch.Tensor, *, group: Any = None, async_op: bool = False) -> Any:
    """All-gather equal-size tensors into one (gloo and NCCL, any torch >= 2.1)."""
    return _all_gather_single(output, input, group=group, async_op=async_op)


@dataclass(frozen=True)
class Slot:
    """One tensor inside a flat buffer: ``buffer[offset : offset + numel]`` viewed as ``shape``.

    ``codec`` compresses it (``NoneCodec`` for a dense slot), ``feedback`` holds its
    error-feedback residual (None: no error feedback), ``seed`` is shared by all ranks.
    """

    key: str
    offset: int
    shape: tuple[int, ...]
    codec: Codec
    seed: int = 0
    feedback: ErrorFeedback | None = None

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def dense(self) -> bool:
        """True when the slot travels uncompressed."""
        return isinstance(self.codec, NoneCodec)


@dataclass(frozen=True)
class Piece:
    """One error-feedback residual of a parameter: ``key`` holds elements ``[lo, hi)``."""

    key: str
    lo: int
    hi: int
    shape: tuple[int, ...]


class CommStats:
    """Thread-safe counters of one user of the collectives (callbacks run on other threads).

    ``bytes_sent`` is what this rank handed to collectives (input buffer sizes);
    ``bytes_wire`` estimates what it transmits on the network (ring all-reduce
    ``2(n-1)/n * B``, all_gather ``(n-1) * B``, all_to_all the pieces bound for other ranks);
    ``dense_bytes`` / ``dense_wire`` are the same for a plain all-reduce of the buffer.
    ``nonfinite_local`` counts slots this rank could not encode (non-finite input),
    ``nonfinite_slots`` slots written as NaN because some rank could not (same on all ranks).
    """

    FIELDS = (
        "buffers", "collectives", "bytes_sent", "bytes_wire", "dense_bytes", "dense_wire",
        "encode_s", "decode_s", "wait_s", "nonfinite_local", "nonfinite_slots",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = dict.fromkeys(self.FIELDS, 0)

    def add(self, **amounts: float) -> None:
        """Add to counters by name."""
        with self._lock:
            for k, v in amounts.items():
                if k not in self._values:
                    raise KeyError(f"unknown statistic {k!r}")
                self._values[k] += v

    def reset(self) -> None:
        """Set every counter to zero."""
        with self._lock:
            self._values = dict.fromkeys(self.FIELDS, 0)

    def load(self, values: Mapping[str, Any]) -> None:
        """Replace the counters by ``values`` (a checkpointed :meth:`as_dict`), after checking them."""
        unknown = set(values) - set(self.FIELDS)
        if unknown:
            raise ValueError(f"unknown statistics {sorted(unknown)}")
        checked: dict[str, float] = dict.fromkeys(self.FIELDS, 0)
        for k, v in values.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise ValueError(f"statistic {k!r} must be a finite number >= 0, got {v!r}")
            checked[k] = v
        with self._lock:
            self._values = checked

    def as_dict(self) -> dict[str, float]:
        """A snapshot of the counters."""
        with self._lock:
            return dict(self._values)


def dense_accounting(stats: CommStats | None, buffer: torch.Tensor, n: int) -> None:
    """Count one buffer and what a plain all-reduce of it would have cost."""
    if stats is not None:
        nbytes = buffer.numel() * buffer.element_size()
        stats.add(buffers=1, dense_bytes=nbytes, dense_wire=2 * (n - 1) * nbytes / n)


def check_slots(buffer: torch.Tensor, slots: Sequence[Slot]) -> torch.Tensor:
    """Check that ``slots`` tile the 1-D contiguous ``buffer`` in order; return it flat."""
    if buffer.dim() != 1 or not buffer.is_contiguous():
        raise CodecError(f"buffer must be 1-D and contiguous, got shape {tuple(buffer.shape)}")
    off = 0
    for s in slots:
        if s.offset != off:
            raise CodecError(f"slot {s.key!r} starts at {s.offset}, expected {off}: slots must tile the buffer")
        off += s.numel
    if off != buffer.numel():
        raise CodecError(f"slots cover {off} elements, buffer has {buffer.numel()}")
    return buffer


def decode_add(codec: Codec, packet: Packet, acc: torch.Tensor, first: bool = False) -> None:
    """Add the decoded packet into ``acc`` (1-D, contiguous, accumulation dtype).

    With ``first`` ``acc`` may hold garbage: it is overwritten with exactly what adding to
    zeros gives (saves zero-filling accumulators that the first rank's decode covers anyway).
    """
    if packet.dtype == acc.dtype:
        codec.decode(packet, out=acc, accumulate=not first)
    elif first:
        acc.copy_(codec.decode(packet))
    else:
        acc.add_(codec.decode(packet).to(acc.dtype))


# ----- a failure on one rank is every rank's error ----------------------------------------------
#: (channel, position) of the collectives issued on this thread: see :meth:`FaultChannel.scope`.
_scope: contextvars.ContextVar[tuple[FaultChannel, str] | None] = contextvars.ContextVar(
    "commpress_fault_scope", default=None
)
_EXIT = "exit"
#: a synchronous wait inside a fault scope checks for other ranks' failures this often (CPU)
WAIT_SLICE_S = 0.1
WAIT_SLICE = datetime.timedelta(seconds=WAIT_SLICE_S)


def _tcp_store(group: Any) -> Any:
    """The TCPStore under the process group's store, or None (other stores, older torch)."""
    from .agreement import _store_of  # agreement imports this module

    store = _store_of(group)
    while store is not None and hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store if store is not None and all(hasattr(store, a) for a in ("clone", "host", "port")) else None


class FaultChannel:
    """Makes one rank's failure every rank's error within milliseconds, at no cost while healthy.

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
    2. **notice**, on every rank: a daemon thread blocks in ``store.wait`` on its own wake key,
       over its own connection (``TCPStore.clone()``, so no other store call queues behind it).
       A blocked wait costs nothing while healthy: no store read per step (a read is a ~60 us
       round trip on loopback, measured), no extra collective, no polling. When the key appears,
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
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, group: Any, store: Any = None) -> None:
        from .agreement import _group_name

        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._prefix = f"commpress/fault/{_group_name(group)}/"
        self._lock = threading.Lock()
        self._fault: tuple[int, str, str] | None = None  # known to every rank (or the acks timed out)
        self._claim: tuple[int, str, str] | None = None  # this rank's own failure, being posted
        self._known = threading.Event()  # set with _fault
        self._pending: dict[int, torch.futures.Future[Any]] = {}
        self._client: Any = None  # posts and acks (clients only: they never keep the store's server up)
        self._thread: threading.Thread | None = None
        if store is None or self.world < 2:
            return
        try:
            self._client, watcher = store.clone(), store.clone()
        except RuntimeError as exc:
            logger.info("commpress: no fault channel (%s): a failure stays on the rank that saw it", exc)
            self._client = None
            return
        self._thread = threading.Thread(target=self._watch, args=(watcher,), name="commpress-faults", daemon=True)
        self._thread.start()

    @classmethod
    def of(cls, group: Any) -> FaultChannel:
        """The channel of ``group`` in this process (its thread started on first use)."""
        from .agreement import _group_name

        store = _tcp_store(group)
        if store is None:
            return cls(group)
        key = (str(store.host), int(store.port), _group_name(group))
        with cls._registry_lock:
            channel = cls._channels.get(key)
            if channel is None or channel._thread is None or not channel._thread.is_alive():
                channel = cls._channels[key] = cls(group, store)
        return channel

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
            return trigger.then(_value)

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

        fut.add_done_callback(complete)
        return trigger.then(_value)

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
            _wait_collective(work)
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
            start = time.monotonic()
            try:
                watcher.wait([key], datetime.timedelta(days=1))
                value = watcher.get(key).decode()
                break
            except Exception:  # noqa: BLE001 - the day-long wait timed out: wait again; else the store went away
                if time.monotonic() - start < 3600:
                    return
        if value == _EXIT:
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

    def close(self) -> None:
        """Stop the watcher thread (at exit)."""
        thread = self._thread
        if thread is None or not thread.is_alive() or self._client is None:
            return
        with contextlib.suppress(Exception):
            self._client.set(self._key("wake", self.rank), _EXIT)
        thread.join(timeout=1.0)


@atexit.register
def _close_channels() -> None:
    for channel in list(FaultChannel._channels.values()):
        channel.close()


def _value(fut: torch.futures.Future[Any]) -> Any:
    return fut.value()  # raises the stored exception inside a callback: a failed future in C++


def _wait_collective(work: Any) -> None:
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
        return fut.then(fn)
    return scope[0].then(fut, fn)


def wait(work: Any, device: torch.device | str = "cpu") -> None:
    """Wait for an async collective on ``device``; inside a :meth:`FaultChannel.scope`, bounded by it."""
    scope = _scope.get()
    if scope is None:
        _wait_collective(work)
    else:
        scope[0].wait(work, torch.device(device))


class StepContext:
    """One buffer's reduction: group, sizes, statistics, saved residuals and the NaN policy."""

    def __init__(self, buffer: torch.Tensor, slots: Sequence[Slot], group: Any, stats: CommStats | None) -> None:
        self.flat = check_slots(buffer, slots)
        self.slots = list(slots)
        self.group = group
        self.n = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.stats = stats
        self.device = buffer.device
        self._saved: dict[int, list[tuple[ErrorFeedback, str]]] = {}
        self._clock = time.perf_counter()
        self._scope = _scope.get()  # set by the adapter (the DDP hook) while it issues this buffer
        dense_accounting(stats, buffer, self.n)

    # ----- helpers for algorithms ----------------------------------------------------------
    def view(self, i: int, flat: torch.Tensor | None = None) -> torch.Tensor:
        """Slot ``i``'s elements in ``flat`` (default: the buffer)."""
        s = self.slots[i]
        return (self.flat if flat is None else flat)[s.offset : s.offset + s.numel]

    def lap(self) -> float:
        """Seconds since the previous lap (or the start)."""
        now = time.perf_counter()
        elapsed, self._clock = now - self._clock, now
        return elapsed

    def count(self, **amounts: float) -> None:
        """Add to the statistics (when there are any)."""
        if self.stats is not None:
            self.stats.add(**amounts)

    def compress(self, i: int, feedback: ErrorFeedback | None, codec: Codec, key: str, x: torch.Tensor, seed: int) -> Packet | None:
        """Encode ``x`` for slot ``i`` (through ``feedback`` under ``key``); None if not finite.

        The residual is saved first, so :meth:`void` can restore it if any rank voids the slot.
        An encoder error caused by the data (fp16 overflow of a scaled value) counts as non-finite.
        """
        if feedback is not None:
            feedback.save(key)
            self._saved.setdefault(i, []).append((feedback, key))
        elif not all_finite(x):
            return None
        try:
            if feedback is not None:
                return feedback.compress(key, x, seed=seed)
            return codec.encode(x, seed=seed)
        except CodecError as exc:
            logger.warning("commpress: cannot encode %r (%s); treated as non-finite", key, exc)
            return None

    def void(self, i: int) -> None:
        """Slot ``i`` is void on every rank: restore the residuals this step changed."""
        for feedback, key in self._saved.pop(i, []):
            feedback.rollback(key)

    def wait(self, work: Any) -> None:
        """Wait for an async collective issued mid-step (bounded by the adapter's fault channel)."""
        if self._scope is None:
            _wait_collective(work)
        else:
            self._scope[0].wait(work, self.device)

    def failed(self, exc: BaseException) -> BaseException:
        """The error to raise when this rank cannot go on with this buffer (posted to every rank)."""
        return exc if self._scope is None else self._scope[0].fail(exc, self._scope[1])

    def finish(self, work: Any, decode: Callable[[], Sequence[bool]]) -> torch.futures.Future[torch.Tensor]:
        """The future DDP waits for: after ``work``, ``decode()`` writes the result into the buffer.

        ``decode`` returns one flag per slot: True where some rank sent no packet (non-finite);
        those slots become NaN on every rank and their residual updates are undone. A ``decode``
        that raises (bytes that do not parse) is this rank's failure: :meth:`failed` posts it.
        """

        def done(fut: torch.futures.Future[Any]) -> torch.Tensor:
            fut.value()  # re-raise a failed collective
            t = time.perf_counter()
            try:
                flags = decode()
            except Exception as exc:
                raise self.failed(exc) from exc
            for i, bad in enumerate(flags):
                if bad:
                    self.view(i).fill_(float("nan"))
                    self.void(i)
            self.count(decode_s=time.perf_counter() - t, nonfinite_slots=sum(flags))
            return self.flat

        return then(work.get_future(), done, self.device, self._scope)


class Algorithm(ABC):
    """A collective algorithm run by :class:`StepContext` (one short file each in this package)."""

    #: Registry name (``CompressionState(algorithm=...)``).
    name: ClassVar[str]
    #: Keeps server-side (second-compression) residuals besides the workers'.
    server_feedback: ClassVar[bool] = False

    def check(self, codec: Codec) -> None:
        """Raise :class:`CodecError` when this algorithm cannot run ``codec``."""

    def residual_layout(self, name: str, shape: tuple[int, ...], codec: Codec, world_size: int) -> list[Piece]:
        """The worker residuals one compressed parameter needs (default: one, its own shape)."""
        return [Piece(name, 0, math.prod(shape), shape)]

    def server_layout(
        self, name: str, shape: tuple[int, ...], codec: Codec, world_size: int, rank: int
    ) -> list[Piece]:
        """The server-side residuals rank ``rank`` owns for one parameter (default: none)."""
        return []

    @abstractmethod
    def launch(
        self, ctx: StepContext, server_feedback: ErrorFeedback | None
    ) -> torch.futures.Future[torch.Tensor]:
        """Encode, issue every collective in order, and return ``ctx.finish(...)``."""
