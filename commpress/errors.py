"""Every exception commpress raises, in one place.

The value errors derive from :class:`ValueError` so callers that already guard against bad
values keep working; every message names the argument, wire field or rank that was wrong.
The parameter server's errors (:class:`PSError` and below) carry an ``exit_code`` for its CLI.
"""

from __future__ import annotations


class CodecError(ValueError):
    """A codec was misconfigured or given input it cannot encode (bad k, NaN, wrong dtype...)."""


class NonFiniteError(CodecError):
    """The values to encode hold NaN or Inf; nothing was encoded and nothing was written."""


class KernelArgumentError(CodecError, RuntimeError):
    """A kernel argument is invalid. A RuntimeError too, like the native ops' TORCH_CHECK."""


class WireError(ValueError):
    """Bytes handed to :func:`commpress.wire.from_bytes` are not a valid commpress packet."""


class ConfigurationError(CodecError):
    """A DDP/FSDP compression state was misconfigured, or ranks disagree about its configuration."""


class RankFailedError(RuntimeError):
    """A rank could not complete a step of the compressed collectives; raised on every rank.

    ``rank`` is the rank that failed, ``where`` the step and bucket (``"step 3, bucket 0"``) and
    ``reason`` what it saw (``"WireError: frame from rank 0: bad header ..."``). From here on the
    ranks' models differ (the failing rank has no average for that bucket): restart from a
    checkpoint.
    """

    def __init__(self, rank: int, where: str, reason: str) -> None:
        super().__init__(
            f"commpress: rank {rank} failed at {where}: {reason}. Every rank of the process group "
            "stops here (the ranks' models now differ): restart from a checkpoint"
        )
        self.rank, self.where, self.reason = rank, where, reason


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
