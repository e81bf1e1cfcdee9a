"""MPI plumbing: byte buffers in, byte buffers out, never pickle, never an unbounded wait.

* Receives use ``Iprobe`` + ``Status.Get_count`` and a buffer-method ``Recv`` into a buffer
  preallocated for the largest valid message. A longer message is consumed into a temporary
  buffer of its actual size and rejected (see :meth:`Inbox.receive`); no buffer is ever sized
  from a header field.
* Sends are ``Isend`` of a contiguous uint8 buffer kept alive in an :class:`Outbox` until MPI
  is done with it. CPU tensors go as zero-copy NumPy views; CUDA tensors go as host copies
  (staged), or, when MPI is CUDA-aware and CuPy is installed, as the device buffer itself
  after the tensor's stream is synchronised (MPI reads it outside any CUDA stream).
  CUDA-awareness is asked of the library (:func:`cuda_aware`): mpi4py's
  ``MPI.Query_cuda_support`` where this mpi4py has it, else Open MPI's
  ``MPIX_Query_cuda_support``; an MPI that cannot say is treated as not CUDA-aware.
* Received messages land in host memory: workers decode replies on the host (bit-identical
  to the server's replica) and copy the result to the device.
* Waits poll with a growing sleep (20 us .. 2 ms), so oversubscribed ranks leave the cores
  to those doing work, and every wait has a deadline.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from .errors import ProtocolError
from .protocol import HEADER_NBYTES

TAG = 7011  #: worker <-> server traffic
TAG_FINAL = 7012  #: servers -> rank 0 at the end of a run


def mpi() -> Any:
    """The ``mpi4py.MPI`` module (imported late: ``--help`` and docs never start MPI)."""
    from mpi4py import MPI

    return MPI


def _cupy() -> Any:
    """CuPy, or None when it is not installed (imported only when device buffers are asked for)."""
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def mpix_cuda_support() -> bool | None:
    """Open MPI's ``MPIX_Query_cuda_support()`` (run-time CUDA support); None without it.

    mpi4py 4.1 does not wrap it, so it is looked up in the MPI library mpi4py loaded (dlsym
    through the extension module's handle, which searches its dependencies). Call after
    ``MPI_Init`` (importing ``mpi4py.MPI`` does it).
    """
    import ctypes

    try:
        fn = ctypes.CDLL(mpi().__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):  # not Open MPI, or built without the extension
        return None
    fn.argtypes, fn.restype = [], ctypes.c_int
    return bool(fn())


def cuda_aware(setting: str) -> bool:
    """Whether to hand MPI device buffers: ``yes``/``no``, or ``auto`` (ask MPI; needs CuPy)."""
    if setting == "no" or _cupy() is None:
        return False
    if setting == "yes":
        return True
    query = getattr(mpi(), "Query_cuda_support", None)  # mpi4py >= 4.2 (MPI 5 / MPIX)
    try:
        if query is not None:
            return bool(query())
        return bool(mpix_cuda_support())
    except Exception:  # noqa: BLE001 - an MPI without the extension: host copies
        return False


class Backoff:
    """Sleep a little longer each time nothing happened; reset when something did."""

    def __init__(self, first: float = 2e-5, cap: float = 2e-3) -> None:
        self.first, self.cap, self.delay = first, cap, 0.0

    def reset(self) -> None:
        """Something happened: poll eagerly again."""
        self.delay = 0.0

    def wait(self) -> None:
        """Sleep the current delay and grow it."""
        if self.delay:
            time.sleep(self.delay)
        self.delay = min(self.cap, max(self.first, self.delay * 2))


def to_mpi(msg: torch.Tensor, device_buffers: bool) -> Any:
    """A buffer MPI can send for the uint8 tensor ``msg`` (see the module docstring)."""
    if msg.device.type == "cpu":
        return msg.numpy()
    cupy = _cupy() if device_buffers and msg.device.type == "cuda" else None
    if cupy is not None:
        # MPI reads the memory outside any stream: the bytes must be written first
        torch.cuda.current_stream(msg.device).synchronize()
        return cupy.asarray(msg.detach().contiguous())  # zero copy (__cuda_array_interface__)
    return msg.detach().contiguous().cpu().numpy()  # staged: synchronous device-to-host copy


class Outbox:
    """Pending ``Isend`` requests with the buffers they read from."""

    def __init__(self, comm: Any, device_buffers: bool = False) -> None:
        self.comm = comm
        self.device_buffers = device_buffers
        self._pending: list[tuple[Any, Any]] = []
        self.msgs = 0
        self.nbytes = 0

    def post(self, dest: int, msg: torch.Tensor | np.ndarray, tag: int = TAG) -> None:
        """Start sending ``msg`` to ``dest``."""
        buf = to_mpi(msg, self.device_buffers) if isinstance(msg, torch.Tensor) else msg
        req = self.comm.Isend([buf, mpi().BYTE], dest=dest, tag=tag)
        self._pending.append((req, buf))
        self.msgs += 1
        self.nbytes += int(msg.numel() if isinstance(msg, torch.Tensor) else msg.size)

    def poll(self) -> None:
        """Drop the requests that have completed."""
        if self._pending:
            self._pending = [(r, b) for r, b in self._pending if not r.Test()]

    def __len__(self) -> int:
        return len(self._pending)

    def flush(self, deadline: float) -> bool:
        """Wait until every send completed or ``deadline`` (monotonic) passed; True if all did."""
        backoff = Backoff()
        while True:
            self.poll()
            if not self._pending:
                return True
            if time.monotonic() > deadline:
                return False
            backoff.wait()

    def cancel(self) -> None:
        """Give up on sends that cannot complete (their receiver is gone)."""
        for req, _ in self._pending:
            try:
                req.Cancel()
                req.Free()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        self._pending.clear()


class Inbox:
    """Receive whole messages of at most ``limit`` bytes from a communicator."""

    def __init__(self, comm: Any, limit: int, tag: int = TAG) -> None:
        comm.Set_errhandler(mpi().ERRORS_RETURN)  # MPI errors as exceptions, not a job abort
        self.comm = comm
        self.limit = limit
        self.tag = tag
        self._status = mpi().Status()
        self._pool = np.empty(max(limit, HEADER_NBYTES), dtype=np.uint8)
        self.msgs = 0
        self.nbytes = 0

    def probe(self, source: int | None = None) -> int | None:
        """Return the sender rank of a waiting message (None when there is none)."""
        src = mpi().ANY_SOURCE if source is None else source
        if self.comm.Iprobe(source=src, tag=self.tag, status=self._status):
            return int(self._status.Get_source())
        return None

    def receive(self, source: int) -> np.ndarray:
        """Receive the message just probed from ``source``; returns a view valid until the next call.

        Raises :class:`ProtocolError` (after consuming the message) when it exceeds the limit.
        """
        count = int(self._status.Get_count(mpi().BYTE))
        self.msgs += 1
        self.nbytes += count
        if count > self.limit:
            # Consume it whole, then reject. Truncating into a small buffer would be the
            # natural way, but Open MPI 5.0 corrupts the heap when a large (rendezvous)
            # message is truncated (measured: malloc assertion, segfault). The allocation is
            # the message's real size, known to MPI, not a size the sender claims.
            junk = np.empty(count, dtype=np.uint8)
            self.comm.Recv([junk, count, mpi().BYTE], source=source, tag=self.tag)
            del junk
            raise ProtocolError(
                f"oversized message: {count} bytes, the largest valid one here is {self.limit}",
                source,
            )
        buf = self._pool[:count]
        self.comm.Recv([buf, count, mpi().BYTE], source=source, tag=self.tag)
        return buf

    def wait(self, sources: Iterable[int] | None, deadline: float) -> tuple[int, np.ndarray] | None:
        """Wait for a message from any of ``sources`` (None: anyone) until ``deadline``."""
        wanted = None if sources is None else list(sources)
        backoff = Backoff()
        while True:
            for src in [None] if wanted is None else wanted:
                got = self.probe(src)
                if got is not None:
                    return got, self.receive(got)
            if time.monotonic() > deadline:
                return None
            backoff.wait()
