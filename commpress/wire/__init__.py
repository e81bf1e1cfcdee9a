"""The wire: what a compressed tensor looks like as bytes, and how several travel together.

- :mod:`.packet`: :class:`Packet` (codec, dtype, numel, params, seed, named sections) and
  :class:`Section`, the in-memory form every codec produces and consumes;
- :mod:`.format`: ``Packet <-> bytes`` (:func:`to_bytes`, :func:`from_bytes`), the byte table,
  strict validation before any payload is read;

Nothing here knows about ``torch.distributed`` or MPI.
"""

from __future__ import annotations

from .format import (
    ALIGN,
    HEADER_NBYTES,
    MAGIC,
    VERSION,
    from_bytes,
    packet_extent,
    packet_nbytes,
    to_bytes,
)
from .packet import FLOAT_DTYPE_CODES, Packet, Section

__all__ = [
    "ALIGN", "FLOAT_DTYPE_CODES", "HEADER_NBYTES", "MAGIC", "Packet", "Section", "VERSION",
    "from_bytes", "packet_extent", "packet_nbytes", "to_bytes",
]
