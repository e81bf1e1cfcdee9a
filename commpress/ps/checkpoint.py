"""Checkpoint files of a parameter-server run: one file per rank and step, no pickle of objects.

Layout of ``DIR``::

    meta.json                      world size, servers, mode and config fingerprint (rank 0)
    rank00000-step000000040.pt     a server: shard, replica, optimizer state, clocks
    rank00002-step000000040.pt     a worker: error-feedback residuals

Files hold only tensors and plain types (``torch.save``; read with ``weights_only=True``) and
are written atomically (temporary file + rename). Each rank keeps its two newest files.
In sync mode every rank saves at the same step boundaries, and a rank can only get to step
``t + every`` after all ranks saved ``t``, so the newest step that *every* rank has is always
complete: :func:`latest_complete` picks it on resume. In async/ssp mode each rank resumes
from its own newest file (async training is not reproducible anyway).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from .errors import ConfigError

FORMAT = 1
_NAME = re.compile(r"^rank(\d{5})-step(\d{9})\.pt$")


def path_for(directory: str, rank: int, step: int) -> str:
    """File name of ``rank``'s checkpoint at ``step``."""
    return os.path.join(directory, f"rank{rank:05d}-step{step:09d}.pt")


def steps_by_rank(directory: str) -> dict[int, list[int]]:
    """Saved steps of each rank, ascending."""
    found: dict[int, list[int]] = {}
    if not os.path.isdir(directory):
        return found
    for name in os.listdir(directory):
        m = _NAME.match(name)
        if m:
            found.setdefault(int(m.group(1)), []).append(int(m.group(2)))
    return {r: sorted(s) for r, s in found.items()}


def latest_complete(directory: str, world: int) -> int | None:
    """The newest step saved by all ``world`` ranks (None when there is none)."""
    found = steps_by_rank(directory)
    if len(found) < world or any(r not in found for r in range(world)):
        return None
    common = set.intersection(*(set(found[r]) for r in range(world)))
    return max(common) if common else None


def latest_own(directory: str, rank: int) -> int | None:
    """The newest step saved by ``rank`` (None when there is none)."""
    steps = steps_by_rank(directory).get(rank)
    return steps[-1] if steps else None


def save(directory: str, rank: int, step: int, state: dict[str, Any], keep: int = 2) -> str:
    """Write ``state`` atomically and delete this rank's files older than the ``keep`` newest."""
    os.makedirs(directory, exist_ok=True)
    path = path_for(directory, rank, step)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save({"format": FORMAT, "rank": rank, "step": step, **state}, tmp)
    os.replace(tmp, path)
    for old in steps_by_rank(directory).get(rank, [])[:-keep]:
        try:
            os.remove(path_for(directory, rank, old))
        except FileNotFoundError:
            pass
    return path


def load(directory: str, rank: int, step: int) -> dict[str, Any]:
    """Read ``rank``'s checkpoint at ``step`` (tensors and plain types only)."""
    path = path_for(directory, rank, step)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unreadable for any reason: say which file
        raise ConfigError(f"cannot read checkpoint {path}: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a commpress.ps checkpoint of format {FORMAT}")
    if state.get("rank") != rank or state.get("step") != step:
        raise ConfigError(f"{path} holds rank {state.get('rank')} step {state.get('step')}")
    return state


def write_meta(directory: str, meta: dict[str, Any]) -> None:
    """Write ``meta.json`` (rank 0, at the start of a fresh run)."""
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f"meta.json.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(directory, "meta.json"))


def check_meta(directory: str, meta: dict[str, Any]) -> None:
    """Raise :class:`ConfigError` when ``meta.json`` in ``directory`` disagrees with ``meta``."""
    path = os.path.join(directory, "meta.json")
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    diff = sorted(k for k in set(saved) | set(meta) if saved.get(k) != meta.get(k))
    if diff:
        raise ConfigError(
            f"checkpoint in {directory} was written by a different run setup ({', '.join(diff)} differ); "
            "use the same world size, servers, mode, model and codecs, or a fresh directory"
        )
