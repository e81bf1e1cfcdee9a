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
  issues a collective: PyTorch's PowerSGD hook does, and gloo then aborts with several buckets).

An :class:`Algorithm` declares the codecs it runs, the residual layout it needs (one residual
per parameter, or per piece of one) and its phases (:meth:`Algorithm.launch`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ..codecs import Codec, NoneCodec
from ..codecs.base import all_finite
from ..errors import CodecError
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

    def finish(self, work: Any, decode: Callable[[], Sequence[bool]]) -> torch.futures.Future[torch.Tensor]:
        """The future DDP waits for: after ``work``, ``decode()`` writes the result into the buffer.

        ``decode`` returns one flag per slot: True where some rank sent no packet (non-finite);
        those slots become NaN on every rank and their residual updates are undone.
        """

        def done(fut: torch.futures.Future[Any]) -> torch.Tensor:
            fut.value()  # re-raise a failed collective
            t = time.perf_counter()
            flags = decode()
            for i, bad in enumerate(flags):
                if bad:
                    self.view(i).fill_(float("nan"))
                    self.void(i)
            self.count(decode_s=time.perf_counter() - t, nonfinite_slots=sum(flags))
            return self.flat

        return work.get_future().then(done)


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
