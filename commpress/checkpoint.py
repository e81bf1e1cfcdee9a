"""Checkpoint files: a digest on every file, private atomic writes, symlinks refused, no pickle of objects.

One file format for everything commpress saves (the parameter server's shards and residuals,
:class:`~commpress.ddp.CompressionState`, :class:`~commpress.fsdp.FSDPCompressionState`): a
40-byte header, then ``torch.save`` bytes of tensors and plain types, read back with
``weights_only=True`` (loading never runs code):

======  ====  ==============================================================
offset  size  field
======  ====  ==============================================================
0       4     ``magic``: ``b"CPCK"`` (parameter server), ``b"CPST"`` (DDP/FSDP states)
4       4     ``format`` of the file (uint32, little-endian)
8       32    ``sha256`` of the bytes that follow
======  ====  ==============================================================

**Reading** (:func:`read_file`), in this order and before the caller changes anything: the path
is a regular file (a symlink is refused: ``O_NOFOLLOW``), the magic and format are the
expected ones, the digest matches (a flipped byte or a truncated write reads as corruption),
the content unpickles with ``weights_only=True``. The digest guards against accidents (disk,
truncation, a bad copy), not against someone who can write the file: they can recompute it.
That is what the callers' plausibility checks bound (:func:`validate`, ``load_state_dict``).

**Writing** (:func:`write_private`): a fresh ``tempfile.mkstemp`` name in the target directory
(unpredictable, created exclusively with mode 0600, so a planted symlink cannot redirect the
write), flushed and fsynced, renamed over the final name (``os.replace`` replaces a symlink
there rather than following it), then the directory is fsynced. A failure (a full disk, a file
size limit) raises :class:`SaveError` naming the path, the cause and the stage, with the old file
in place; a kill leaves the old file or the new one, and the next save removes the temporary
file a killed one left (``tests/test_save_pressure.py``).

**Another world size** (:func:`resized`, :func:`resize_warning`): the rule the DDP and FSDP
states share when a process group of another size loads a state (a resize, not a mix-up),
and the one warning naming what it dropped.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import stat
import struct
import tempfile
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .checks import MAX_PLAUSIBLE_ABS, check_loaded_tensor

#: magic of the parameter server's files (:mod:`commpress.ps.checkpoint`)
PS_MAGIC = b"CPCK"
#: magic and format of a DDP / FSDP compression state file (:func:`save_state`)
STATE_MAGIC = b"CPST"
STATE_FILE_FORMAT = 1
_HEAD = struct.Struct("<4sI32s")
HEADER_NBYTES = _HEAD.size  # 40
#: Largest magnitude :func:`validate` accepts in any tensor or float by default.
MAX_ABS = MAX_PLAUSIBLE_ABS
_INT64 = 1 << 63


class CheckpointError(ValueError):
    """A checkpoint file cannot be trusted or read: refused, corrupt, another format, implausible."""


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


class SaveError(OSError):
    """Writing a checkpoint failed (full disk, quota, file size limit, permissions): nothing was replaced.

    An ``OSError`` (``errno`` the cause's, ``path`` the file that was being saved) whose message
    names the path, the cause and the stage; the file at ``path`` is what it was before the
    call, the temporary file is removed, and the state that was being saved is unchanged, so a
    retry once the cause is fixed writes the same checkpoint.
    """

    def __init__(self, errno: int | None, message: str, path: str) -> None:
        super().__init__(errno, message)
        #: the file that was being saved
        self.path = path


#: length of the random part of a ``tempfile.mkstemp`` name
_MKSTEMP_RANDOM = 8


def _temp_affixes(path: str) -> tuple[str, str]:
    """The prefix and suffix of :func:`write_private`'s temporary names for ``path``."""
    return f".{os.path.basename(path)}.", ".tmp"


def _remove_stale_temps(path: str, before: float, keep: str) -> int:
    """Remove temporary files an earlier, killed :func:`write_private` of ``path`` left behind.

    Only names of exactly the ``mkstemp`` shape of ``path``'s temporary files, regular files
    (not symlinks), last modified before ``before`` (this call's own start, so a save of the
    same path still in flight elsewhere is spared), and never ``keep``. Errors are ignored: a
    leftover is a few wasted bytes, never a wrong checkpoint (it has another name, and a
    partial one fails the digest). Returns how many were removed.
    """
    directory = os.path.dirname(path) or "."
    prefix, suffix = _temp_affixes(path)
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if (not name.startswith(prefix) or not name.endswith(suffix)
                or len(name) != len(prefix) + _MKSTEMP_RANDOM + len(suffix)):
            continue
        full = os.path.join(directory, name)
        if full == keep:
            continue
        try:
            st = os.lstat(full)
            if stat.S_ISREG(st.st_mode) and st.st_mtime < before:
                os.remove(full)
                removed += 1
        except OSError:
            continue
    return removed


def write_private(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically through a private temporary file (mode 0600).

    The temporary name comes from ``tempfile.mkstemp`` in the same directory (exclusive
    creation, unpredictable name); it is fsynced, then renamed over ``path``. A process killed
    at any point leaves ``path`` as it was or complete (never half a file) and at most a
    temporary ``.NAME.XXXXXXXX.tmp`` beside it, which the next save of ``path`` removes.

    Raises:
        SaveError: creating, writing, syncing or renaming failed (a full disk: ``ENOSPC``; a
            file size limit: ``EFBIG``); ``path`` is unchanged and the temporary file removed.
    """
    directory = os.path.dirname(path) or "."
    prefix, suffix = _temp_affixes(path)
    started = time.time()
    stage = "creating a temporary file"
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=suffix)
        stage = f"writing {len(data)} bytes"
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            stage = "syncing"
            os.fsync(f.fileno())
        stage = "renaming the temporary file into place"
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            try:
                os.remove(tmp)
            except FileNotFoundError:
                pass
        if isinstance(exc, OSError):
            cause = exc.strerror or str(exc)
            raise SaveError(exc.errno, f"cannot save {path}: {cause} ({stage} in {directory}); {path} is unchanged "
                            f"and the temporary file was removed: fix the cause and save again", path) from exc
        raise
    _fsync_dir(directory)
    _remove_stale_temps(path, started, keep=tmp)


def read_regular(path: str, what: str = "checkpoint") -> bytes:
    """The bytes of ``path``, refusing a symlink or anything but a regular file."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise CheckpointError(f"cannot read {what} {path}: {exc.strerror or exc} (a symlink is refused)") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise CheckpointError(f"{what} {path} is not a regular file")
        return f.read()


def frame(body: bytes, *, magic: bytes, fmt: int) -> bytes:
    """``body`` behind its header (magic, format, sha256 of ``body``): a file's bytes."""
    return _HEAD.pack(magic, fmt, hashlib.sha256(body).digest()) + body


def encode(state: Mapping[str, Any], *, magic: bytes, fmt: int) -> bytes:
    """Header (magic, format, sha256 of the body) followed by ``torch.save`` bytes of ``state``."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return frame(buf.getvalue(), magic=magic, fmt=fmt)


def decode(data: bytes, path: str, *, magic: bytes, fmt: int, what: str) -> Any:
    """Check header and digest of a file's bytes, then unpickle its body with ``weights_only=True``."""
    if len(data) < HEADER_NBYTES or data[:4] != magic:
        raise CheckpointError(f"cannot read {what} {path}: not a {what} file (no {magic!r} header)")
    _, found, digest = _HEAD.unpack_from(data)
    if found != fmt:
        raise CheckpointError(f"{path} is a {what} file of format {found}; this build reads format {fmt}")
    body = memoryview(data)[HEADER_NBYTES:]
    if hashlib.sha256(body).digest() != digest:
        raise CheckpointError(f"{path} is corrupt: its sha256 digest does not match its content")
    try:
        return torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unreadable for any reason: say which file
        raise CheckpointError(f"cannot read {what} {path}: {type(exc).__name__}: {str(exc)[:200]}") from None


def write_file(path: str, state: Mapping[str, Any], *, magic: bytes, fmt: int) -> None:
    """:func:`encode` ``state`` and write it with :func:`write_private`."""
    write_private(path, encode(state, magic=magic, fmt=fmt))


def read_file(path: str, *, magic: bytes, fmt: int, what: str) -> Any:
    """Read a file written by :func:`write_file`: regular file, header, digest, then content."""
    return decode(read_regular(path, what), path, magic=magic, fmt=fmt, what=what)


def _walk(value: Any, where: str) -> Iterator[tuple[str, Any]]:
    """Yield ``(path, leaf)`` for every leaf of nested dicts, lists and tuples."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _walk(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _walk(v, f"{where}[{i}]")
    else:
        yield where, value


def validate(state: Mapping[str, Any], *, like: Mapping[str, Any] | None = None, max_abs: float = MAX_ABS,
             what: str = "checkpoint") -> None:
    """Raise :class:`CheckpointError` naming the entry unless every value of ``state`` is plausible.

    Floating tensors and floats: finite, magnitude at most ``max_abs``; integers within 64 bits;
    with ``like``: ``state`` has ``like``'s structure (every key of its mappings, lists of the
    same length, tensors of the same shape and dtype, other values of the same type: a loader
    can then convert them without TypeError). Reads only; nothing is changed.
    """
    for where, v in _walk(state, ""):
        if isinstance(v, torch.Tensor):
            if v.is_floating_point() or v.is_complex():
                check_loaded_tensor(v, f"{what}: {where}", dtypes=None, max_abs=max_abs, error=CheckpointError)
            elif v.dtype != torch.bool and v.numel():
                if int(v.min()) < -_INT64 or int(v.max()) >= _INT64:  # uint64 beyond int64
                    raise CheckpointError(f"{what}: {where} holds an integer outside int64")
        elif isinstance(v, bool) or v is None or isinstance(v, str):
            continue
        elif isinstance(v, int):
            if not -_INT64 <= v < 2 * _INT64:  # uint64 too: fingerprints are unsigned
                raise CheckpointError(f"{what}: {where} = {v} is outside the 64-bit integer range")
        elif isinstance(v, float):
            if not math.isfinite(v) or abs(v) > max_abs:
                raise CheckpointError(f"{what}: {where} = {v} is not finite or beyond {max_abs:g}")
    if like is not None:
        _check_like(state, like, "", what)


def _check_like(got: Any, want: Any, where: str, what: str) -> None:
    """Raise :class:`CheckpointError` unless ``got`` has the structure of ``want``.

    Mappings holding its keys, lists of its length, tensors of its shape and dtype, other values
    of its type (found by fuzzing: a ``clock`` of another length or ``skipped_steps=None``
    reached the loaders).
    """
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise CheckpointError(f"{what}: {where} is missing (expected a {want.dtype} tensor of shape {tuple(want.shape)})")
        if got.shape != want.shape or got.dtype != want.dtype:
            raise CheckpointError(f"{what}: {where} is {got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}")
    elif isinstance(want, Mapping):
        if not isinstance(got, Mapping):
            raise CheckpointError(f"{what}: {where or 'the state'} is a {type(got).__name__}, expected a mapping")
        for k, v in want.items():
            path = f"{where}.{k}" if where else str(k)
            if k not in got:
                if isinstance(v, torch.Tensor):
                    _check_like(None, v, path, what)
                raise CheckpointError(f"{what}: {path} is missing")
            _check_like(got[k], v, path, what)
    elif isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            raise CheckpointError(f"{what}: {where} is {type(got).__name__} {got!r:.60}, expected a list of {len(want)}")
        for i, (g, w) in enumerate(zip(got, want)):
            _check_like(g, w, f"{where}[{i}]", what)
    elif type(got) is not type(want):
        raise CheckpointError(f"{what}: {where} is a {type(got).__name__}, expected a {type(want).__name__}")


# ----- DDP / FSDP compression states -----------------------------------------------------------
def save_state(path: str, state: Mapping[str, Any]) -> None:
    """Write a compression state's ``state_dict()`` to ``path`` (digest, private, atomic)."""
    write_file(path, state, magic=STATE_MAGIC, fmt=STATE_FILE_FORMAT)


def load_state(path: str, what: str = "commpress state") -> dict[str, Any]:
    """Read a file :func:`save_state` wrote; its owner's ``load_state_dict`` then validates the values."""
    state = read_file(path, magic=STATE_MAGIC, fmt=STATE_FILE_FORMAT, what=what)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} does not hold a {what} (a {type(state).__name__})")
    return state


# ----- a load at another world size (DDP and FSDP states) -------------------------------------------
def resized(saved: Mapping[str, Any], world_size: int, rank: int, hint: str) -> bool:
    """True when ``saved`` (a state's ``state_dict()``) was written at another world size: a resize.

    A resize loads what is the same on every rank and drops the per-rank state with one warning
    (:func:`resize_warning`). The same world size with another rank's state is a mix-up, not a
    resize: ValueError (``rank mismatch``, followed by ``hint`` in parentheses).
    """
    saved_world, saved_rank = saved["world_size"], saved["rank"]
    if not isinstance(saved_world, int) or isinstance(saved_world, bool) or not 1 <= saved_world < 1 << 31:
        raise ValueError(f"world_size must be a positive int, got {saved_world!r}")
    if not isinstance(saved_rank, int) or isinstance(saved_rank, bool) or not 0 <= saved_rank < saved_world:
        raise ValueError(f"rank must be an int in [0, world_size={saved_world}), got {saved_rank!r}")
    if saved_world == world_size and saved_rank != rank:
        raise ValueError(f"rank mismatch: checkpoint has {saved_rank}, this state {rank} ({hint})")
    return saved_world != world_size


def _count_and_norm(tensors: Any) -> tuple[int, float]:
    """How many tensors a (nested) mapping holds, and the 2-norm of all of them as one vector."""
    count, total = 0, 0.0
    for v in (tensors or {}).values():
        if isinstance(v, torch.Tensor):
            count, total = count + 1, total + float(v.double().square().sum())
        elif isinstance(v, Mapping):
            n, norm = _count_and_norm(v)
            count, total = count + n, total + norm**2
    return count, total**0.5


def resize_warning(what: str, saved: Mapping[str, Any], world_size: int, rank: int, *, kept: str,
                   dropped: Mapping[str, Any], source: str = "file") -> str:
    """The one warning of a load at another world size: what was kept, and each per-rank part dropped.

    ``dropped``: label (``"error-feedback residual(s)"``) -> the (nested) mapping of tensors that
    start empty, named with their count and norm. Why drop rather than redistribute: the update is
    the mean over ranks of the compressed ``g + e``, so what error feedback owes is
    ``sum(e) / W``; keeping it at ``W'`` ranks needs every old rank's residuals on the new ranks,
    and one state per rank (written on nodes that may no longer exist) does not give that. What
    is lost is bounded: a residual is what compression has not sent yet, a few steps' worth of
    gradient (the divergence guard's ratio measures it), and a velocity is momentum that rebuilds
    in ``~1/(1-momentum)`` steps (as ``torch.optim.SGD`` starts one from the next gradient).
    """
    parts = []
    for label, tensors in dropped.items():
        count, norm = _count_and_norm(tensors)
        parts.append(f"{count} {label} (norm {norm:.4g})")
    return (
        f"{what}: checkpoint written by {saved['world_size']} ranks ({source} of rank {saved['rank']}) "
        f"loaded at {world_size} ranks (rank {rank}): loaded {kept}; dropped this rank's per-rank state: "
        f"{' and '.join(parts)}, which start empty"
    )


class StateFile:
    """``save(path)`` / ``load(path)`` for a state with ``state_dict`` / ``load_state_dict`` (DDP, FSDP)."""

    __slots__ = ()
    #: names the state in load errors
    file_what = "commpress state"

    def state_dict(self) -> dict[str, Any]:
        """The state to save (the class defines it)."""
        raise NotImplementedError

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Validate and restore ``state`` (the class defines it)."""
        raise NotImplementedError

    def save(self, path: str) -> None:
        """Write :meth:`state_dict` to ``path`` (one file per rank): sha256 digest, private atomic write.

        The file is created through a fresh ``mkstemp`` name with mode 0600 and renamed over
        ``path`` (a symlink there is replaced, never followed). A failure raises
        :class:`SaveError` (an ``OSError``) naming ``path`` and the cause; ``path`` and this
        state are unchanged, so calling ``save`` again once the cause is fixed works.
        """
        save_state(path, self.state_dict())

    def load(self, path: str) -> None:
        """Restore a file :meth:`save` wrote, all or nothing.

        Refuses a symlink, checks the digest (a flipped byte or a truncated file raises
        :class:`CheckpointError`), then :meth:`load_state_dict` validates every value; the state
        changes only if all of it passes.
        """
        self.load_state_dict(load_state(path, self.file_what))


__all__ = [
    "HEADER_NBYTES", "MAX_ABS", "PS_MAGIC", "STATE_FILE_FORMAT", "STATE_MAGIC", "CheckpointError", "SaveError", "StateFile",
    "decode", "resize_warning", "resized",
    "encode", "frame", "load_state", "read_file", "read_regular", "save_state", "validate", "write_file", "write_private",
]
