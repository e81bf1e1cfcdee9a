"""The parameter server's exceptions; they live in :mod:`commpress.errors` with all the others."""

from __future__ import annotations

from ..errors import ConfigError, ProtocolError, PSError, ServerTimeout, WorkerTimeout

__all__ = ["ConfigError", "PSError", "ProtocolError", "ServerTimeout", "WorkerTimeout"]
