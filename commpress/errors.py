"""Exceptions raised by commpress.

Both derive from :class:`ValueError` so callers that already guard against bad values keep
working; the message always names the argument or wire field that was wrong.
"""

from __future__ import annotations


class CodecError(ValueError):
    """A codec was misconfigured or given input it cannot encode (bad k, NaN, wrong dtype...)."""


class WireError(ValueError):
    """Bytes handed to :func:`commpress.wire.from_bytes` are not a valid commpress packet."""
