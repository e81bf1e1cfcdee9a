"""Compression statistics where users look: TensorBoard (or any ``add_scalar`` writer) and Lightning.

:func:`flatten_stats` turns a state's ``stats()`` (:class:`commpress.ddp.CompressionState`,
:class:`commpress.fsdp.FSDPCompressionState`) into scalar metrics named
``<prefix>/<key>``: ``commpress/compression_ratio``, ``commpress/bytes_sent``,
``commpress/guard_ratio``, ... Numbers pass as floats, bools become 0/1, anything else is
skipped; nested mappings join their keys with ``/``. ``codec="auto"``'s choices are already
numeric in ``stats()``: ``auto_<option>_buckets`` counts the buckets per option and
``auto_b<i>_choice`` is bucket ``i``'s option as an index into
:data:`commpress.comm.costmodel.OPTIONS` (0 dense, 1 fp16, 2 compressed).

``state.log_to(writer, every=N)`` attaches a :class:`StatsLogger`: the state itself writes the
flattened stats after every ``N``-th step (in the DDP hook after a step's last bucket, in the
FSDP reduce-scatter after a step's last module), with ``global_step`` the state's step count,
on rank 0 only unless ``all_ranks=True``. Nothing to call per step. Writing costs no device
synchronisation (the statistics are host-side counters). The counters are cumulative, and the
step's last bucket may still be in flight when they are written (its decode time, and the
two-phase algorithm's second-phase bytes, then show in the next write). Call
:meth:`StatsLogger.write` for a point at any other time (say after the last step), and
close the writer as usual. A writer that raises is reported once as a warning and not used
again: a broken logger never stops training.

Example::

    from torch.utils.tensorboard import SummaryWriter

    state = commpress.ddp.register(ddp_model, "topk", ratio=0.01)
    state.log_to(SummaryWriter("runs/topk"), every=50)
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

logger = logging.getLogger("commpress")

#: The default tag prefix of :func:`flatten_stats` and ``log_to``.
PREFIX = "commpress"


class ScalarWriter(Protocol):
    """What :class:`StatsLogger` writes to: ``torch.utils.tensorboard.SummaryWriter`` and the like."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> Any:
        """Record ``scalar_value`` under ``tag`` at ``global_step``."""
        ...


def flatten_stats(stats: Mapping[str, Any], prefix: str = PREFIX) -> dict[str, float]:
    """Scalar metrics ``{"<prefix>/<key>": float}`` of a ``stats()`` dict.

    Args:
        stats: a state's ``stats()`` (or any mapping of names to values).
        prefix: put before every key with a ``/``; ``""``: the keys as they are.

    Returns:
        One float per number (ints and floats, NaN and infinities kept), bool (0.0 / 1.0) or
        one-element tensor; nested mappings flattened with ``/``; other values (strings,
        ``None``, lists) skipped.
    """
    out: dict[str, float] = {}
    for key, value in stats.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten_stats(value, name))
        elif isinstance(value, bool):
            out[name] = 1.0 if value else 0.0
        elif isinstance(value, numbers.Real):
            out[name] = float(value)
        elif isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
            out[name] = float(value.item())
    return out


class StatsLogger:
    """Writes a state's flattened ``stats()`` to a writer every ``every`` steps (``state.log_to``).

    Args:
        stats: returns the statistics (the state's ``stats`` method).
        writer: anything with ``add_scalar(tag, value, global_step)``, e.g. a
            ``torch.utils.tensorboard.SummaryWriter``.
        every: write after steps ``every, 2 * every, ...`` (a positive int).
        prefix: the tag prefix (:func:`flatten_stats`).
        rank: this process's rank in the state's process group.
        all_ranks: write on every rank (give each rank its own writer, or a prefix naming the
            rank); ``False`` (default): on rank 0 only.
    """

    def __init__(
        self,
        stats: Callable[[], Mapping[str, Any]],
        writer: ScalarWriter,
        *,
        every: int = 50,
        prefix: str = PREFIX,
        rank: int = 0,
        all_ranks: bool = False,
    ) -> None:
        if not callable(getattr(writer, "add_scalar", None)):
            raise TypeError(f"writer needs an add_scalar(tag, value, global_step) method, got {type(writer).__name__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1, got {every!r}")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {prefix!r}")
        if not isinstance(all_ranks, bool):
            raise TypeError(f"all_ranks must be a bool, got {all_ranks!r}")
        self._stats = stats
        self.writer = writer
        self.every = every
        self.prefix = prefix
        #: False on the ranks that do not write (all but rank 0 unless ``all_ranks``), or once stopped
        self.active = all_ranks or rank == 0
        #: how many times the metrics were written
        self.writes = 0

    def after_step(self, step: int) -> None:
        """Called by the state after each step with its step count: write when ``step`` is a multiple of ``every``."""
        if self.active and step % self.every == 0:
            self.write(step)

    def write(self, step: int) -> None:
        """Write the flattened statistics now at ``global_step=step`` (on the ranks that write).

        An exception from the writer is logged once as a warning and stops this logger.
        """
        if not self.active:
            return
        try:
            for tag, value in flatten_stats(self._stats(), self.prefix).items():
                self.writer.add_scalar(tag, value, step)
        except Exception:
            self.active = False
            logger.warning("commpress: writing the stats to %s failed at step %d; not writing them again",
                           type(self.writer).__name__, step, exc_info=True)
            return
        self.writes += 1

    def stop(self) -> None:
        """Write nothing more (the state keeps calling :meth:`after_step`, which does nothing)."""
        self.active = False

    def __repr__(self) -> str:
        return (f"StatsLogger(writer={type(self.writer).__name__}, every={self.every}, prefix={self.prefix!r}, "
                f"active={self.active}, writes={self.writes})")



class LogsStats:
    """``log_to`` for a compression state: a mixin for classes with ``stats()``, ``rank`` and a ``_stats_log`` slot.

    The DDP and FSDP states share it; each calls ``self._stats_log.after_step(step)`` (when set)
    at the end of its step.
    """

    __slots__ = ()  # the slot itself is the subclass's (two bases with slots cannot be combined)
    rank: int
    stats: Callable[[], Mapping[str, Any]]
    _stats_log: StatsLogger | None

    def log_to(
        self, writer: ScalarWriter, *, every: int = 50, prefix: str = PREFIX, all_ranks: bool = False
    ) -> StatsLogger:
        """Write :meth:`stats` to ``writer`` (a TensorBoard ``SummaryWriter``) every ``every`` steps.

        The state writes them itself at the end of every ``every``-th step (DDP: after the last
        bucket; FSDP: after the last module's reduce-scatter), with ``global_step`` the step count;
        call it on every rank, only rank 0 writes unless ``all_ranks``. A later call replaces this logger.

        Args:
            writer: anything with ``add_scalar(tag, value, global_step)``.
            every: write after steps ``every, 2 * every, ...``.
            prefix: tags are ``<prefix>/<key>`` (``commpress/compression_ratio``, ...).
            all_ranks: write on every rank (give each its own writer or prefix).

        Returns:
            The :class:`StatsLogger` (``.write(step)`` writes now, ``.stop()`` stops).
        """
        logger = StatsLogger(self.stats, writer, every=every, prefix=prefix, rank=self.rank, all_ranks=all_ranks)
        self._stats_log = logger  # type: ignore[misc]  # a slot of the subclass
        return logger


__all__ = ["PREFIX", "LogsStats", "ScalarWriter", "StatsLogger", "flatten_stats"]
