"""What the soaks (scripts/soak.py: DDP, scripts/soak_ps.py: parameter server) share.

Per rank, :func:`sample` reads the process's resident memory, open file descriptors and
threads, and :func:`digest` condenses tensors' bytes into one int64; :func:`report` prints
the table of those samples (one row per recording step) with the growth after warm-up.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

#: :func:`sample`'s fields, in order
FIELDS = ("rss_kb", "fds", "threads")


def _proc_status(field: str) -> int:
    """An integer field of ``/proc/self/status`` (``VmRSS`` in kB, ``Threads``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def sample() -> list[int]:
    """This process's ``[VmRSS in kB, open file descriptors, threads]``."""
    return [_proc_status("VmRSS"), len(os.listdir("/proc/self/fd")), _proc_status("Threads")]


def digest(tensors: Iterable[torch.Tensor]) -> int:
    """The first 63 bits of a sha256 over the tensors' bytes (fits an int64)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "little") >> 1


@dataclass
class Row:
    """One recording step: every rank's :func:`sample` and whether the check held there."""

    step: int
    samples: Sequence[Sequence[int]]  #: per rank, in :data:`FIELDS` order
    same: bool


@dataclass
class Growth:
    """What :func:`report` measured between the first row after warm-up and the last."""

    first_step: int
    last_step: int
    rss_percent: list[float]
    fds: list[int]
    threads: list[int]
    identical_everywhere: bool


def report(rows: Sequence[Row], names: Sequence[str], warmup: int, same_header: str = "ranks identical") -> Growth:
    """Print the markdown table (RSS per rank, fds, threads, the check) and the growth lines."""
    print("| step | " + " | ".join(f"RSS {n} MB" for n in names) + f" | fds | threads | {same_header} |")
    print("|---" * (len(names) + 4) + "|")
    for row in rows:
        fds = "/".join(str(s[1]) for s in row.samples)
        threads = "/".join(str(s[2]) for s in row.samples)
        print(f"| {row.step} | " + " | ".join(f"{s[0] / 1024:.1f}" for s in row.samples)
              + f" | {fds} | {threads} | {'yes' if row.same else 'NO'} |")
    after = [row for row in rows if row.step > warmup] or list(rows)
    first, last = after[0], rows[-1]
    growth = Growth(
        first.step, last.step,
        [100.0 * (b[0] - a[0]) / a[0] for a, b in zip(first.samples, last.samples)],
        [b[1] - a[1] for a, b in zip(first.samples, last.samples)],
        [b[2] - a[2] for a, b in zip(first.samples, last.samples)],
        all(row.same for row in rows),
    )
    print(f"RSS growth from step {growth.first_step} to {growth.last_step}: "
          + ", ".join(f"{n} {g:+.2f}%" for n, g in zip(names, growth.rss_percent)))
    print(f"fd growth {growth.fds}, thread growth {growth.threads}")
    return growth
