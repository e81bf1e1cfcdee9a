"""A server's counters (:class:`Stats`), their totals over servers and its JSON-lines event log.

Plain data and a file: no MPI, no training logic. The server fills them; rank 0 sums them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Stats:
    """Counters of one server (bytes include the 48-byte headers)."""

    msgs_in: int = 0
    bytes_in: int = 0
    push_msgs: int = 0
    push_bytes: int = 0
    reply_msgs: int = 0
    reply_bytes: int = 0
    step_reply_msgs: int = 0
    step_reply_bytes: int = 0
    params_replies: int = 0
    rejected: dict[int, int] = field(default_factory=dict)
    implausible: dict[int, int] = field(default_factory=dict)
    skipped_pushes: int = 0
    resyncs: int = 0
    max_drift: float = 0.0
    max_ahead: int = 0
    dropped: list[int] = field(default_factory=list)
    wall_seconds: float = 0.0
    seconds: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k in ("validate", "decode", "apply", "reply")})

    def as_dict(self) -> dict[str, Any]:
        """Plain-data copy (JSON-ready)."""
        d = dict(self.__dict__)
        d["rejected"] = {str(k): v for k, v in self.rejected.items()}
        d["implausible"] = {str(k): v for k, v in self.implausible.items()}
        d["seconds"] = dict(self.seconds)
        d["dropped"] = list(self.dropped)
        return d


def gather_stats(stats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Totals over servers (used by rank 0's summary)."""
    total: dict[str, Any] = {"servers": len(stats)}
    for key in ("msgs_in", "bytes_in", "push_msgs", "push_bytes", "reply_msgs", "reply_bytes", "step_reply_msgs",
                "step_reply_bytes", "resyncs", "skipped_pushes", "params_replies"):
        total[key] = sum(int(s[key]) for s in stats)
    total["max_drift"] = max(float(s["max_drift"]) for s in stats)
    total["max_ahead"] = max(int(s["max_ahead"]) for s in stats)
    total["rejected"] = sum(sum(s["rejected"].values()) for s in stats)
    total["implausible"] = sum(sum(s.get("implausible", {}).values()) for s in stats)
    total["dropped"] = sorted({r for s in stats for r in s["dropped"]})
    return total


class EventLog:
    """JSON-lines event log of one server (``log_dir/server-<shard>.jsonl``)."""

    def __init__(self, log_dir: str | None, shard: int) -> None:
        self._f = None
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
            self._f = open(os.path.join(log_dir, f"server-{shard}.jsonl"), "a")

    def __call__(self, event: dict[str, Any]) -> None:
        """Write one event line."""
        if self._f is not None:
            self._f.write(json.dumps(event) + "\n")

    def close(self) -> None:
        """Flush and close the file."""
        if self._f is not None:
            self._f.close()
            self._f = None
