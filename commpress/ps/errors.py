"""Exceptions of the parameter server, each naming the rank it is about."""

from __future__ import annotations


class PSError(RuntimeError):
    """A parameter-server run cannot continue (misconfiguration, protocol breach, timeout)."""

    exit_code = 1


class ConfigError(PSError, ValueError):
    """Bad options: wrong rank count, unknown mode, invalid codec spec, incompatible checkpoint."""

    exit_code = 2


class ProtocolError(PSError, ValueError):
    """One message failed validation; the receiver rejects it and keeps serving.

    ``sender`` is the MPI rank the message came from (None when unknown).
    """

    def __init__(self, message: str, sender: int | None = None) -> None:
        super().__init__(message if sender is None else f"from rank {sender}: {message}")
        self.reason = message
        self.sender = sender


class WorkerTimeout(PSError):
    """A worker sent nothing within the timeout while the run needed it (fatal in sync mode)."""

    exit_code = 3

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class ServerTimeout(PSError):
    """A worker got no reply from a server within its deadline."""

    exit_code = 4

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank
