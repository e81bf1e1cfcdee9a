"""Checkpoint files of a parameter-server run: one file per rank and step, no pickle of objects.

Layout of ``DIR`` (created with mode 0700)::

    meta.json                      world size, servers, mode and config fingerprint (rank 0)
    rank00000-step000000040.pt     a server: shard, replica, optimizer state, clocks
    rank00002-step000000040.pt     a worker: error-feedback residuals

A ``.pt`` file is a 40-byte header followed by ``torch.save`` bytes of tensors and plain types
(read with ``weights_only=True``, so loading never runs code):

======  ====  ==============================================================
offset  size  field
======  ====  ==============================================================
0       4     ``magic``: ``b"CPCK"``
4       4     ``format``: :data:`FORMAT` (uint32, little-endian)
8       32    ``sha256`` of the bytes that follow
======  ====  ==============================================================

Integrity and trust, in the order :func:`load` checks them, all before the caller changes any
state: the file is a regular file (a symlink is refused), its digest matches (a flipped byte or a
truncated write is reported as corruption), it is a commpress checkpoint of this format for this
rank and step, and every value in it is plausible: tensors finite with magnitudes at most
``max_abs`` (:data:`MAX_ABS` = 1e15 by default: parameters, residuals and optimizer moments of a
healthy run are many orders of magnitude below it, while a flipped exponent bit gives values
like 3.5e37), integers within 64 bits, and with ``like`` (the caller's own ``state_dict()``) every
tensor there present with the same shape and dtype. The digest guards against accidents (disk,
truncation, a bad copy), not against someone who can write the directory: such a person can
recompute it, which is what the plausibility checks bound.

Writes are atomic and private: each file is written to a fresh ``tempfile.mkstemp`` name in
the target directory (unpredictable, created exclusively with mode 0600, so a planted symlink
cannot redirect the write), flushed and fsynced, then renamed over the final name (``os.replace``
replaces a symlink there rather than following it), and the directory is fsynced. The file
machinery (header, digest, private writes, symlink refusal, :func:`validate`) is shared with
the DDP and FSDP states' files: :mod:`commpress.checkpoint`; this module adds the directory
layout, the rank and step checks and :class:`ConfigError` (exit code 2) for the CLI.
Each rank keeps its two newest files.
In sync mode every rank saves at the same step boundaries, and a rank can only get to step
``t + every`` after all ranks saved ``t``, so the newest step that *every* rank has is always
complete: :func:`latest_complete` picks it on resume. In async/ssp mode each rank resumes
from its own newest file (async training is not reproducible anyway).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

from .. import checkpoint as files
from .errors import ConfigError

FORMAT = 2
MAGIC = files.PS_MAGIC
HEADER_NBYTES = files.HEADER_NBYTES  # 40
#: Largest magnitude :func:`load` accepts in any tensor or float of a checkpoint (see above).
MAX_ABS = files.MAX_ABS
_NAME = re.compile(r"^rank(\d{5})-step(\d{9})\.pt$")
write_private = files.write_private


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


def _read_regular(path: str) -> bytes:
    """The bytes of ``path``, refusing a symlink or anything but a regular file."""
    try:
        return files.read_regular(path)
    except files.CheckpointError as exc:
        raise ConfigError(str(exc)) from None


def save(directory: str, rank: int, step: int, state: dict[str, Any], keep: int = 2) -> str:
    """Write ``state`` atomically and privately, then delete this rank's files older than the ``keep`` newest."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = path_for(directory, rank, step)
    files.write_file(path, {"format": FORMAT, "rank": rank, "step": step, **state}, magic=MAGIC, fmt=FORMAT)
    for old in steps_by_rank(directory).get(rank, [])[:-keep]:
        try:
            os.remove(path_for(directory, rank, old))
        except FileNotFoundError:
            pass
    return path


def validate(state: Mapping[str, Any], *, like: Mapping[str, Any] | None = None, max_abs: float = MAX_ABS, what: str = "checkpoint") -> None:
    """Raise :class:`ConfigError` naming the entry unless every value of ``state`` is plausible.

    Floating tensors and floats: finite, magnitude at most ``max_abs``; integers within 64 bits;
    with ``like``: every tensor in ``like`` present in ``state`` at the same path with the same
    shape and dtype (:func:`commpress.checkpoint.validate`). Reads only; nothing is changed.
    """
    try:
        files.validate(state, like=like, max_abs=max_abs, what=what)
    except files.CheckpointError as exc:
        raise ConfigError(str(exc)) from None


def load(
    directory: str, rank: int, step: int, *, like: Mapping[str, Any] | None = None, max_abs: float = MAX_ABS
) -> dict[str, Any]:
    """Read and check ``rank``'s checkpoint at ``step``: digest, format, rank, step, values.

    ``like``: the caller's own ``state_dict()``, whose tensors fix the shapes and dtypes the
    checkpoint must have. Raises :class:`ConfigError` naming the file and what is wrong; the
    caller has changed nothing yet when it does.
    """
    path = path_for(directory, rank, step)
    try:
        state = files.read_file(path, magic=MAGIC, fmt=FORMAT, what="commpress.ps checkpoint")
    except files.CheckpointError as exc:
        raise ConfigError(str(exc)) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a commpress.ps checkpoint of format {FORMAT}")
    if state.get("rank") != rank or state.get("step") != step:
        raise ConfigError(f"{path} holds rank {state.get('rank')} step {state.get('step')}")
    validate(state, like=like, max_abs=max_abs, what=path)
    return state


def write_meta(directory: str, meta: dict[str, Any]) -> None:
    """Write ``meta.json`` (rank 0, at the start of a fresh run), atomically and privately."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    write_private(os.path.join(directory, "meta.json"), json.dumps(meta, indent=1, sort_keys=True).encode())


def check_meta(directory: str, meta: dict[str, Any]) -> None:
    """Raise :class:`ConfigError` when ``meta.json`` in ``directory`` disagrees with ``meta``."""
    path = os.path.join(directory, "meta.json")
    try:
        saved = json.loads(_read_regular(path))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    diff = sorted(k for k in set(saved) | set(meta) if saved.get(k) != meta.get(k))
    if diff:
        raise ConfigError(
            f"checkpoint in {directory} was written by a different run setup ({', '.join(diff)} differ); "
            "use the same world size, servers, mode, model and codecs, or a fresh directory"
        )
