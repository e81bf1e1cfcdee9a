"""The one skeleton every collective algorithm runs on: slots, frames, accounting, the NaN policy.

An algorithm reduces one flat gradient buffer (a DDP bucket, FSDP's flat gradient, any 1-D
tensor) cut into :class:`Slot` s, one per tensor. What every algorithm needs is done here, once:

- the slots are checked to tile the buffer;
- **frames**: :meth:`StepContext.encode_frames` encodes each slot's piece for each destination
  (:class:`Part`) into one frame per destination and packs them end to end;
  :meth:`StepContext.decode_frames` decodes n frames in rank order into an accumulator,
  flagging missing packets;
- accounting (:class:`~.stats.CommStats`) and timing (encode, decode, wait);
- **the non-finite policy.** :meth:`StepContext.compress` encodes a slot through its error
  feedback, first saving the residual; a slot whose input is not finite (or whose encode
  overflows) yields None, and the algorithm carries a flag instead of a packet. Every rank sees
  the same flags after the collective, so :meth:`StepContext.finish` writes NaN into that slot on
  every rank (``GradScaler`` then skips the step everywhere) and restores the residuals saved
  before this step: a voided step leaves no trace in anyone's error feedback;
- **one ordered issue path.** Algorithms issue every collective from the calling thread, in call
  order; the future :meth:`StepContext.finish` returns only decodes (a ``then`` callback never
  issues a collective: PyTorch's PowerSGD hook does, and gloo then aborts with several buckets);
- **a failure on one rank reaches every rank** through the adapter's fault scope
  (:class:`~.faults.FaultChannel`): waits and futures handed out here are bounded by it.

An :class:`Algorithm` declares the codecs it runs, the residual layout it needs, the bytes it
sends (:meth:`Algorithm.wire_plan`, what the cost model reads) and its phases
(:meth:`Algorithm.launch`).
"""

from __future__ import annotations

import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
import torch.distributed as dist

from ..codecs import Codec, NoneCodec
from ..codecs.base import all_finite
from ..errors import CodecError, RankFailedError
from ..feedback import ErrorFeedback
from ..wire.frame import FrameLayout
from ..wire.packet import Packet
from .faults import WAIT_SLICE_S, FaultChannel, current_scope, then, wait, wait_collective
from .stats import CommStats, dense_accounting
from .store import all_gather_single

logger = logging.getLogger("commpress")


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


@dataclass(frozen=True)
class Part:
    """One frame entry: elements ``[lo, hi)`` of slot ``slot``, encoded under ``key`` with ``seed``.

    ``shape``: encode the elements viewed as this shape (the whole slot's), else flat.
    """

    slot: int
    lo: int
    hi: int
    key: str
    seed: int
    shape: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Entry:
    """One tensor of a buffer, for :meth:`Algorithm.wire_plan`: ``numel`` elements, compressed or dense."""

    numel: int
    compressed: bool


@dataclass
class Encoded:
    """What :meth:`StepContext.encode_frames` made: one layout per destination, the packed bytes.

    ``sizes[j]`` bytes of ``send`` go to destination ``j`` (0 for the skipped one);
    ``bad[u]``: unit ``u`` (entry ``u`` of every frame) travels flagged, from this rank.
    """

    layouts: list[FrameLayout]
    send: torch.Tensor
    sizes: list[int]
    bad: list[bool]


def frame_layout(entries: Sequence[Entry], codec: Codec, dtype: torch.dtype) -> FrameLayout:
    """The frame an algorithm builds for ``entries`` (dense ones as ``none``): for :meth:`Algorithm.wire_plan`."""
    dense = NoneCodec()
    return FrameLayout([(i, codec if e.compressed else dense, e.numel) for i, e in enumerate(entries)], dtype)


def empty_plan() -> dict[str, float]:
    """A :meth:`Algorithm.wire_plan` with no collective (fill in what the algorithm issues)."""
    return {"allreduce": 0.0, "allgather": 0.0, "alltoall": 0.0, "decodes": 1.0}


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
    """One buffer's reduction: group, sizes, statistics, saved residuals and the NaN policy.

    ``output`` (with ``average``): the shard a reduce-scatter ends in (:attr:`Algorithm.shards`);
    the buffer's baseline is then a ring reduce-scatter's bytes, not an all-reduce's.
    """

    def __init__(
        self, buffer: torch.Tensor, slots: Sequence[Slot], group: Any, stats: CommStats | None,
        *, output: torch.Tensor | None = None, average: bool = True,
    ) -> None:
        self.flat = check_slots(buffer, slots)
        self.slots = list(slots)
        self.group = group
        self.n = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.stats = stats
        self.device = buffer.device
        self.output = output
        self.average = average
        self._saved: dict[int, list[tuple[ErrorFeedback, str]]] = {}
        self._clock = time.perf_counter()
        self._scope = current_scope()  # set by the adapter (the DDP hook) while it issues this buffer
        dense_accounting(stats, buffer, self.n, scatter=output is not None)

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

    def layout(self, parts: Sequence[Part]) -> FrameLayout:
        """The frame of ``parts`` (each in its slot's codec, the buffer's dtype)."""
        return FrameLayout([(p.key, self.slots[p.slot].codec, p.hi - p.lo) for p in parts], self.flat.dtype)

    def encode_frames(self, frames: Sequence[Sequence[Part]], *, skip: int | None = None, precheck: bool = False) -> Encoded:
        """Encode frame ``j``'s parts (dense slots without error feedback) and pack the frames end to end.

        Entry ``u`` of every frame is one unit (a slot, or one parameter's chunks): a unit whose
        input is not finite (with ``precheck``: checked before any residual is touched) or one of
        whose parts cannot be encoded travels flagged in every frame, so every receiver sees it.
        Frame ``skip`` (this rank's own, kept exact) is checked but neither encoded nor sent.
        """
        layouts = [self.layout(f) for f in frames]
        units = len(frames[0]) if frames else 0
        packets: list[list[Packet | None]] = [[None] * units for _ in frames]
        bad = [False] * units
        for u in range(units):
            parts = [f[u] for f in frames]
            views = [self.view(p.slot)[p.lo : p.hi] for p in parts]
            if precheck and not all(all_finite(x) for x in views):
                bad[u] = True
                continue  # nothing encoded: residuals untouched
            for j, (p, x) in enumerate(zip(parts, views)):
                if j != skip:
                    s = self.slots[p.slot]
                    packets[j][u] = self.compress(p.slot, None if s.dense else s.feedback, s.codec, p.key,
                                                  x if p.shape is None else x.view(p.shape), p.seed)
            if any(packets[j][u] is None for j in range(len(frames)) if j != skip):
                bad[u] = True
                for row in packets:
                    row[u] = None
        sizes = [0 if j == skip else lay.nbytes for j, lay in enumerate(layouts)]
        send = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
        off = 0
        for j, lay in enumerate(layouts):
            if sizes[j]:
                lay.pack(packets[j], out=send[off : off + lay.nbytes])
                off += lay.nbytes
        return Encoded(layouts, send, sizes, bad)

    def decode_frames(
        self, recv: torch.Tensor, layouts: Sequence[FrameLayout | None], into: Callable[[int, int], torch.Tensor],
        *, width: int | None = None, own: Callable[[bool], None] | None = None, accumulate: bool = True,
    ) -> list[bool]:
        """Decode frame ``j`` of ``recv`` (``layouts[j]``) in rank order, entry ``i`` into ``into(j, i)``.

        Frames lie end to end, or every ``width`` bytes. With ``accumulate`` the first frame
        overwrites (``into`` may hold garbage) and the others add, in the accumulation dtype;
        without, every packet overwrites its target. A ``None`` layout is this rank's own part:
        ``own(first)`` adds it in its place. Returns one flag per entry: some frame had no packet.
        """
        bad = [False] * max((len(lay) for lay in layouts if lay is not None), default=0)
        off = 0
        for j, lay in enumerate(layouts):
            if lay is None:
                if own is not None:
                    own(j == 0)
                continue
            start = j * width if width is not None else off
            frame = lay.unpack(recv[start : start + lay.nbytes], source=j)
            off += lay.nbytes
            for i, p in enumerate(frame):
                if p is None:
                    bad[i] = True
                elif p.numel:
                    # the layout holds the Codec objects this step's slots gave it (the wire types them as WireCodec)
                    decode_add(cast(Codec, lay.codecs[i]), p, into(j, i), first=j == 0 or not accumulate)
        return bad

    def void(self, i: int) -> None:
        """Slot ``i`` is void on every rank: restore the residuals this step changed."""
        for feedback, key in self._saved.pop(i, []):
            feedback.rollback(key)

    def wait(self, work: Any) -> None:
        """Wait for an async collective issued mid-step (bounded by the adapter's fault channel)."""
        if self._scope is None:
            wait_collective(work)
        else:
            self._scope[0].wait(work, self.device)

    def failed(self, exc: BaseException) -> BaseException:
        """The error to raise when this rank cannot go on with this buffer (posted to every rank)."""
        return exc if self._scope is None else self._scope[0].fail(exc, self._scope[1])

    def finish(
        self, work: Any, decode: Callable[[], Sequence[bool]], *, nonfinite: Callable[[Sequence[bool]], int] = sum,
    ) -> torch.futures.Future[torch.Tensor]:
        """The future the adapter waits for: after ``work`` (None: waited for), ``decode()`` writes the result.

        ``decode`` returns one flag per slot: True where some rank sent no packet (non-finite);
        those slots become NaN on every rank and their residual updates are undone
        (``nonfinite(flags)`` of them are counted). A ``decode`` that raises (bytes that do not
        parse) is this rank's failure: :meth:`failed` posts it.
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
            self.count(decode_s=time.perf_counter() - t, nonfinite_slots=nonfinite(flags))
            return self.flat

        if work is None:
            fut: torch.futures.Future[Any] = torch.futures.Future()
            fut.set_result(None)
        else:
            fut = work.get_future()
        return then(fut, done, self.device, self._scope)


class Algorithm(ABC):
    """A collective algorithm run by :class:`StepContext` (one short file each in this package)."""

    #: Registry name (``CompressionState(algorithm=...)``).
    name: ClassVar[str]
    #: Keeps server-side (second-compression) residuals besides the workers'.
    server_feedback: ClassVar[bool] = False
    #: Ends with this rank's shard in ``ctx.output`` (a reduce-scatter), not the whole average.
    shards: ClassVar[bool] = False

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

    def flush_weights(self, world_size: int) -> tuple[float, float]:
        """How many times a dense step adds a worker and a server residual into this rank's gradient.

        A worker residual is of this rank's own gradient (1); a server residual is of the
        average over ``world_size`` ranks (``world_size``, so the dense all-reduce's mean holds it once).
        """
        return 1.0, float(world_size)

    def wire_plan(self, entries: Sequence[Entry], codec: Codec, n: int, dtype: torch.dtype) -> dict[str, float]:
        """Bytes each collective hands over per rank, and decodes per element (the cost model's input).

        ``{"allreduce": B, "allgather": B, "alltoall": B, "decodes": k}``, absent collectives 0
        (:func:`empty_plan`), from the same frame layouts :meth:`launch` builds.
        """
        raise CodecError(f"algorithm {self.name!r} states no wire plan: the cost model cannot price it")

    @abstractmethod
    def launch(
        self, ctx: StepContext, server_feedback: ErrorFeedback | None
    ) -> torch.futures.Future[torch.Tensor]:
        """Encode, issue every collective in order, and return ``ctx.finish(...)``."""


__all__ = [
    "WAIT_SLICE_S", "Algorithm", "CommStats", "Encoded", "Entry", "FaultChannel", "Part", "Piece", "RankFailedError",
    "Slot", "StepContext", "all_gather_single", "check_slots", "decode_add", "dense_accounting", "empty_plan",
    "frame_layout", "then", "wait",
]
