"""The reduction of DiLoCo's pseudo-gradient: codec, slots, error feedback, and the skip of a bad sync.

One flat buffer holds ``theta_global - theta_local`` of every trainable parameter (in
``named_parameters`` order); :meth:`OuterReduction.reduce` averages it over the ranks through one
commpress collective (:func:`commpress.comm.run`: the codec's default algorithm at this world
size, one :class:`~commpress.comm.Slot` per parameter, seeds ``derive_seed(seed, sync, index)``
that every rank computes alike). Every parameter of at least ``min_numel`` elements travels
compressed (:class:`~commpress.selection.SelectionRule` with ``dense_1d=False``; default 0: all
of them, biases and norm scales too). Per-step DDP keeps those dense, since they are a sliver of
the bytes there; here, after 16x fewer sends, they were 11% of what DiLoCo sent (the byte LM: 22,400 of
5.77M elements at 32 bits against 1), and sending them as sign with error feedback ended at or
below the dense-1-D loss (docs/local.md). Error feedback follows the collectives' default: on for the
biased codecs (top-k, sign: what they drop is carried to the next sync), off for the unbiased
ones (QSGD, whose variance would make the residual grow).

**Non-finite pseudo-gradients.** A rank whose slot is not finite sends a flag, not a packet, and
every rank writes NaN there (the driver's policy; a dense all-reduce propagates NaN by itself),
so every rank reads the same verdict from the same reduced buffer: :meth:`reduce` returns False
on all of them alike, and restores every residual to what it held before the sync, so a skipped
sync leaves no trace in the error feedback.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .. import comm
from .. import options as opts
from ..codecs import Codec, NoneCodec
from ..comm import CommStats, Slot
from ..errors import CodecError
from ..feedback import ErrorFeedback
from ..rng import derive_seed
from ..selection import SelectionRule

#: DiLoCo's default ``min_numel``: every parameter goes through the codec (module docstring)
DEFAULT_OUTER_MIN_NUMEL = 0


class OuterReduction:
    """Averages one flat pseudo-gradient buffer over the ranks with a codec (see the module docstring)."""

    def __init__(self, names: Sequence[str], shapes: Sequence[tuple[int, ...]], dtype: torch.dtype,
                 codec: str | Codec, codec_params: dict[str, Any], *, world_size: int, rank: int, seed: int,
                 min_numel: int = DEFAULT_OUTER_MIN_NUMEL) -> None:
        self.codec = comm.resolve_codec(codec, codec_params, "DiLoCo's outer reduction")
        self.algorithm = comm.check_algorithm("auto", self.codec, world_size)
        self.seed = opts.check_seed(seed)
        self.world_size = world_size
        rule = SelectionRule(min_numel, dense_1d=False)
        lossless = isinstance(self.codec, NoneCodec)
        self.names, self.shapes = list(names), [tuple(s) for s in shapes]
        numels = [math.prod(s) for s in self.shapes]
        self.compressed = [not lossless and rule(n, s, k) for n, s, k in zip(self.names, self.shapes, numels)]
        for name, shape, numel, on in zip(self.names, self.shapes, numels, self.compressed):
            if on:
                try:
                    self.codec.wire_size(numel, dtype)
                    self.codec.wire_params(numel)
                except CodecError as exc:
                    raise CodecError(f"parameter {name!r} {shape}: {exc} (min_numel={numel + 1} "
                                     "would send it and every smaller parameter dense)") from None
        self.offsets = [0, *itertools.accumulate(numels)][:-1]
        self.error_feedback = bool(opts.error_feedback_default(None, self.codec)) and not self.codec.lossless
        algorithm = comm.get(self.algorithm)
        self.worker: ErrorFeedback | None = None
        self.server: ErrorFeedback | None = None
        if self.error_feedback:
            kept = [(n, s) for n, s, c in zip(self.names, self.shapes, self.compressed) if c]
            self.worker = ErrorFeedback(self.codec, {p.key: p.shape for n, s in kept
                                                     for p in algorithm.residual_layout(n, s, self.codec, world_size)})
            if algorithm.server_feedback:
                self.server = ErrorFeedback(self.codec, {p.key: p.shape for n, s in kept
                                                         for p in algorithm.server_layout(n, s, self.codec, world_size, rank)})
        self.counters = CommStats()

    def slots(self, sync: int, first: int = 0, stop: int | None = None) -> list[Slot]:
        """The slots of sync ``sync`` for parameters ``first:stop`` (default all), offsets from the first one.

        One slot per parameter, compressed or dense; seed ``derive_seed(seed, sync, index)`` with
        the parameter's index in the whole model, which every rank computes alike.
        """
        stop = len(self.names) if stop is None else stop
        base = self.offsets[first] if first < len(self.offsets) else 0
        dense = NoneCodec()
        return [
            Slot(key=self.names[i], offset=self.offsets[i] - base, shape=self.shapes[i],
                 codec=self.codec if self.compressed[i] else dense,
                 seed=derive_seed(self.seed, sync, i), feedback=self.worker if self.compressed[i] else None)
            for i in range(first, stop)
        ]

    def launch(self, buffer: torch.Tensor, sync: int, group: Any, first: int = 0,
               stop: int | None = None) -> PendingReduction:
        """Start averaging ``buffer`` (parameters ``first:stop``, end to end) in place: an async collective.

        Encoding (and the residual update) happens here, on this thread; the collective and the
        decode run on the backend's threads (gloo) until :meth:`finish`.
        """
        slots = self.slots(sync, first, stop)
        keys = {s.key for s in slots}
        saved = [_snapshot(ef, keys) for ef in (self.worker, self.server)]
        before = self.counters.as_dict().get("bytes_sent", 0.0)
        fut = comm.run(self.algorithm, buffer, slots, group=group, server_feedback=self.server, stats=self.counters)
        return PendingReduction(fut, buffer, saved, self.counters.as_dict().get("bytes_sent", 0.0) - before)

    def finish(self, pending: PendingReduction) -> bool:
        """After ``pending.future`` completed: True if the average is finite (the same on every rank).

        When it is not, every residual the sync changed is restored to what it held before.
        """
        pending.future.wait()
        if bool(torch.isfinite(pending.buffer).all()):
            return True
        for ef, snap in zip((self.worker, self.server), pending.saved):
            _restore(ef, snap)
        return False

    def reduce(self, buffer: torch.Tensor, sync: int, group: Any) -> bool:
        """Average ``buffer`` (every parameter) in place over the ranks; False (on every rank alike) when not finite."""
        return self.finish(self.launch(buffer, sync, group))

    def config(self) -> dict[str, Any]:
        """What all ranks must agree on (plain types)."""
        return {"codec": self.codec.config(), "algorithm": self.algorithm, "error_feedback": self.error_feedback,
                "seed": self.seed, "compressed": list(self.compressed)}

    def state_dict(self) -> dict[str, Any]:
        """Residuals (worker and two-phase server side), as :class:`ErrorFeedback` states."""
        return {"worker": None if self.worker is None else self.worker.state_dict(),
                "server": None if self.server is None else self.server.state_dict()}

    def check_state(self, state: Any) -> None:
        """Raise ValueError naming the bad entry unless :meth:`load_state_dict` would accept ``state``."""
        if not isinstance(state, Mapping) or set(state) != {"worker", "server"}:
            raise ValueError(f"feedback must be a mapping with 'worker' and 'server', got {state!r:.80}")
        for side, ef in (("worker", self.worker), ("server", self.server)):
            if (state[side] is None) != (ef is None):
                raise ValueError(f"feedback.{side}: checkpoint {'has no' if state[side] is None else 'has'} "
                                 f"residuals, this DiLoCo {'keeps' if ef is not None else 'keeps none'}")
            if ef is not None:
                probe = ErrorFeedback(ef.codec, ef.shapes)
                try:
                    probe.load_state_dict(state[side])
                except ValueError as exc:
                    raise ValueError(f"feedback.{side}: {exc}") from None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (check it first with :meth:`check_state`)."""
        for side, ef in (("worker", self.worker), ("server", self.server)):
            if ef is not None:
                ef.reset()
                ef.load_state_dict(state[side])


class PendingReduction:
    """A launched outer reduction: its future, the buffer it completes, the residuals it may restore."""

    __slots__ = ("buffer", "future", "nbytes", "saved")

    def __init__(self, future: torch.futures.Future[torch.Tensor], buffer: torch.Tensor,
                 saved: list[dict[str, torch.Tensor | None]], nbytes: float) -> None:
        self.future, self.buffer, self.saved, self.nbytes = future, buffer, saved, nbytes


def _snapshot(ef: ErrorFeedback | None, keys: set[str]) -> dict[str, torch.Tensor | None]:
    """The residuals of ``ef`` whose key is (or, two-phase, starts with) one of ``keys``; None: absent."""
    if ef is None:
        return {}
    out: dict[str, torch.Tensor | None] = {}
    for k in ef.shapes or {}:
        if k not in keys and k.rsplit("#", 1)[0] not in keys:
            continue
        r = ef.residual(k)
        if r is None:
            out[k] = None
            continue
        out[k] = r.clone()
    return out


def _restore(ef: ErrorFeedback | None, snap: dict[str, torch.Tensor | None]) -> None:
    if ef is None:
        return
    for k, v in snap.items():
        ef.set_residual(k, v)


__all__ = ["DEFAULT_OUTER_MIN_NUMEL", "OuterReduction", "PendingReduction"]
