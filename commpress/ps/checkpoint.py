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
tensor there present with the same shape and dtype and every other entry with the same type
and length. The digest guards against accidents (disk, truncation, a bad copy), not against
someone who can write the directory: such a person can recompute it, which is what the
plausibility checks bound.

Writes are atomic and private: each file is written to a fresh ``tempfile.mkstemp`` name in
the target directory (unpredictable, created exclusively with mode 0600, so a planted symlink
cannot redirect the write), flushed and fsynced, then renamed over the final name (``os.replace``
replaces a symlink there rather than following it), and the directory is fsynced.
Each rank keeps its two newest files.
In sync mode every rank saves at the same step boundaries, and a rank can only get to step
``t + every`` after all ranks saved ``t``, so the newest step that *every* rank has is always
complete: :func:`latest_complete` picks it on resume. In async/ssp mode each rank resumes
from its own newest file (async training is not reproducible anyway).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import stat
import struct
import tempfile
from collections.abc import Mapping
from typing import Any

import torch

from ..feedback import MAX_PLAUSIBLE_ABS
from .errors import ConfigError

FORMAT = 2
MAGIC = b"CPCK"
_HEAD = struct.Struct("<4sI32s")
HEADER_NBYTES = _HEAD.size  # 40
#: Largest magnitude :func:`load` accepts in any tensor or float of a checkpoint (see above).
MAX_ABS = MAX_PLAUSIBLE_ABS
_INT64 = 1 << 63
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


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot fsync a directory: the rename is still atomic
        pass
    finally:
        os.close(fd)


def write_private(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically through a private temporary file (mode 0600).

    The temporary name comes from ``tempfile.mkstemp`` in the same directory (exclusive
    creation, unpredictable name); it is fsynced, then renamed over ``path``.
    """
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)


def _read_regular(path: str) -> bytes:
    """The bytes of ``path``, refusing a symlink or anything but a regular file."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise ConfigError(f"cannot read checkpoint {path}: {exc.strerror or exc} (a symlink is refused)") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ConfigError(f"checkpoint {path} is not a regular file")
        return f.read()


def save(directory: str, rank: int, step: int, state: dict[str, Any], keep: int = 2) -> str:
    """Write ``state`` atomically and privately, then delete this rank's files older than the ``keep`` newest."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = path_for(directory, rank, step)
    buf = io.BytesIO()
    torch.save({"format": FORMAT, "rank": rank, "step": step, **state}, buf)
    body = buf.getvalue()
    write_private(path, _HEAD.pack(MAGIC, FORMAT, hashlib.sha256(body).digest()) + body)
    for old in steps_by_rank(directory).get(rank, [])[:-keep]:
        try:
            os.remove(path_for(directory, rank, old))
        except FileNotFoundError:
            pass
    return path


def _walk(value: Any, where: str) -> Any:
    """Yield ``(path, leaf)`` for every leaf of nested dicts, lists and tuples."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _walk(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _walk(v, f"{where}[{i}]")
    else:
        yield where, value


def validate(state: Mapping[str, Any], *, like: Mapping[str, Any] | None = None, max_abs: float = MAX_ABS, what: str = "checkpoint") -> None:
    """Raise :class:`ConfigError` naming the entry unless every value of ``state`` is plausible.

    Floating tensors and floats: finite, magnitude at most ``max_abs``; integers within 64 bits;
    with ``like``: ``state`` has ``like``'s structure (every key of its mappings, lists of the
    same length, tensors of the same shape and dtype, other values of the same type: a loader
    can then convert them without TypeError). Reads only; nothing is changed.
    """
    for where, v in _walk(state, ""):
        if isinstance(v, torch.Tensor):
            if v.is_floating_point() or v.is_complex():
                if v.numel() == 0:
                    continue
                if not bool(torch.isfinite(v).all()):
                    raise ConfigError(f"{what}: {where} holds NaN or Inf")
                top = float(v.abs().max())
                if top > max_abs:
                    raise ConfigError(f"{what}: {where} holds {top:.4g}, beyond the plausible magnitude {max_abs:g} (corrupt?)")
            elif v.dtype != torch.bool and v.numel():
                if int(v.min()) < -_INT64 or int(v.max()) >= _INT64:  # uint64 beyond int64
                    raise ConfigError(f"{what}: {where} holds an integer outside int64")
        elif isinstance(v, bool) or v is None or isinstance(v, str):
            continue
        elif isinstance(v, int):
            if not -_INT64 <= v < 2 * _INT64:  # uint64 too: fingerprints are unsigned
                raise ConfigError(f"{what}: {where} = {v} is outside the 64-bit integer range")
        elif isinstance(v, float):
            if not math.isfinite(v) or abs(v) > max_abs:
                raise ConfigError(f"{what}: {where} = {v} is not finite or beyond {max_abs:g}")
    if like is not None:
        _check_like(state, like, "", what)


def _check_like(got: Any, want: Any, where: str, what: str) -> None:
    """Raise :class:`ConfigError` unless ``got`` has the structure of ``want``.

    Mappings holding its keys, lists of its length, tensors of its shape and dtype, other values
    of its type.
    """
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise ConfigError(f"{what}: {where} is missing (expected a {want.dtype} tensor of shape {tuple(want.shape)})")
        if got.shape != want.shape or got.dtype != want.dtype:
            raise ConfigError(f"{what}: {where} is {got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}")
    elif isinstance(want, Mapping):
        if not isinstance(got, Mapping):
            raise ConfigError(f"{what}: {where or 'the state'} is a {type(got).__name__}, expected a mapping")
        for k, v in want.items():
            path = f"{where}.{k}" if where else str(k)
            if k not in got:
                if isinstance(v, torch.Tensor):
                    _check_like(None, v, path, what)
                raise ConfigError(f"{what}: {path} is missing")
            _check_like(got[k], v, path, what)
    elif isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            raise ConfigError(f"{what}: {where} is {type(got).__name__} {got!r:.60}, expected a list of {len(want)}")
        for i, (g, w) in enumerate(zip(got, want)):
            _check_like(g, w, f"{where}[{i}]", what)
    elif type(got) is not type(want):
        raise ConfigError(f"{what}: {where} is a {type(got).__name__}, expected a {type(want).__name__}")


def load(
    directory: str, rank: int, step: int, *, like: Mapping[str, Any] | None = None, max_abs: float = MAX_ABS
) -> dict[str, Any]:
    """Read and check ``rank``'s checkpoint at ``step``: digest, format, rank, step, values.

    ``like``: the caller's own ``state_dict()``, whose tensors fix the shapes and dtypes the
    checkpoint must have. Raises :class:`ConfigError` naming the file and what is wrong; the
    caller has changed nothing yet when it does.
    """
    path = path_for(directory, rank, step)
    data = _read_regular(path)
    if len(data) < HEADER_NBYTES or data[:4] != MAGIC:
        raise ConfigError(f"cannot read checkpoint {path}: not a commpress.ps checkpoint (no {MAGIC!r} header)")
    _, fmt, digest = _HEAD.unpack_from(data)
    if fmt != FORMAT:
        raise ConfigError(f"{path} is a commpress.ps checkpoint of format {fmt}; this build reads format {FORMAT}")
    body = memoryview(data)[HEADER_NBYTES:]
    if hashlib.sha256(body).digest() != digest:
        raise ConfigError(f"{path} is corrupt: its sha256 digest does not match its content")
    try:
        state = torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unreadable for any reason: say which file
        raise ConfigError(f"cannot read checkpoint {path}: {type(exc).__name__}: {str(exc)[:200]}") from None
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
