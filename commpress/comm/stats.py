"""Counters of what one user of the collectives sent and spent: :class:`CommStats`.

Bytes handed to collectives and estimated on the wire, next to what a plain all-reduce (or
ring reduce-scatter) of the same buffer would cost; encode, decode and wait time; non-finite
slots. Shared by every algorithm and adapter, read by ``stats()`` and checkpoints.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch


class CommStats:
    """Thread-safe counters of one user of the collectives (callbacks run on other threads).

    ``bytes_sent`` is what this rank handed to collectives (input buffer sizes);
    ``bytes_wire`` estimates what it transmits on the network (ring all-reduce
    ``2(n-1)/n * B``, all_gather ``(n-1) * B``, all_to_all the pieces bound for other ranks);
    ``dense_bytes`` / ``dense_wire`` are the same for a plain all-reduce of the buffer.
    ``nonfinite_local`` counts slots this rank could not encode (non-finite input),
    ``nonfinite_slots`` slots written as NaN because some rank could not (same on all ranks).
    ``intra_*`` / ``inter_*``: the parts of ``bytes_sent`` / ``bytes_wire`` the hierarchical
    algorithm (:mod:`.hierarchical`) hands over inside a node and across nodes (0 when flat).
    """

    FIELDS = (
        "buffers", "collectives", "bytes_sent", "bytes_wire", "dense_bytes", "dense_wire",
        "encode_s", "decode_s", "wait_s", "nonfinite_local", "nonfinite_slots",
        "intra_bytes_sent", "intra_bytes_wire", "inter_bytes_sent", "inter_bytes_wire",
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


def dense_accounting(stats: CommStats | None, buffer: torch.Tensor, n: int, *, scatter: bool = False) -> None:
    """Count one buffer and what a plain all-reduce of it would have cost.

    With ``scatter``, what a ring reduce-scatter of it sends per rank instead (``(n-1)/n`` of it,
    on the wire and handed over alike): the baseline of a collective that ends in a shard.
    """
    if stats is not None:
        nbytes = buffer.numel() * buffer.element_size()
        if scatter:
            dense = (n - 1) * nbytes / n
            stats.add(buffers=1, dense_bytes=dense, dense_wire=dense)
        else:
            stats.add(buffers=1, dense_bytes=nbytes, dense_wire=2 * (n - 1) * nbytes / n)


__all__ = ["CommStats", "dense_accounting"]


class LevelStats(CommStats):
    """One level of a two-level reduction, counted into ``target`` with its bytes also as ``<level>_*``.

    ``level`` is ``"intra"`` (inside a node) or ``"inter"`` (across nodes). ``drop`` names
    counters the outer step counts once for the whole buffer (:data:`TOTALS`: ``buffers`` and the
    dense baseline; with ``"nonfinite_slots"`` the slots written as NaN too) when this is the
    second level of one reduction. Keeps no counters of its own.
    """

    #: what a second level leaves to the first: the buffer and its dense baseline
    TOTALS = ("buffers", "dense_bytes", "dense_wire")

    def __init__(self, target: CommStats | None, level: str, drop: tuple[str, ...] = ()) -> None:
        if level not in ("intra", "inter"):
            raise ValueError(f"level must be 'intra' or 'inter', got {level!r}")
        self._target, self._level, self._drop = target, level, drop

    def add(self, **amounts: float) -> None:
        """Forward to the target, bytes also under this level's names."""
        if self._target is None:
            return
        for dropped in self._drop:
            amounts.pop(dropped, None)
        for what in ("bytes_sent", "bytes_wire"):
            if what in amounts:
                amounts[f"{self._level}_{what}"] = amounts[what]
        self._target.add(**amounts)

