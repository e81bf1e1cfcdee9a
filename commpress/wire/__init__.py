"""The wire: what a compressed tensor looks like as bytes, and how several travel together.

- :mod:`.packet`: :class:`Packet` (codec, dtype, numel, params, seed, named sections) and
  :class:`Section`, the in-memory form every codec produces and consumes;
- :mod:`.format`: ``Packet <-> bytes`` (:func:`to_bytes`, :func:`from_bytes`), the byte table,
  strict validation before any payload is read, checked against what the receiver
  expects (:class:`Expect`);
- :mod:`.frame`: :class:`FrameLayout`, the one multi-packet container (DDP frames and
  parameter-server payloads): sizes, per-entry "no packet" flags, validation of every packet
  against its entry before anything is decoded.

Nothing here knows about ``torch.distributed`` or MPI.
"""

from __future__ import annotations

from .format import (
    ALIGN,
    HEADER_NBYTES,
    MAGIC,
    MAX_NUMEL,
    VERSION,
    Expect,
    from_bytes,
    packet_extent,
    packet_nbytes,
    read_packet,
    to_bytes,
)
from .frame import FrameLayout
from .packet import FLOAT_DTYPE_CODES, Packet, Section

__all__ = [
    "ALIGN", "Expect", "FLOAT_DTYPE_CODES", "FrameLayout", "HEADER_NBYTES", "MAGIC", "MAX_NUMEL", "Packet", "Section",
    "VERSION", "from_bytes", "packet_extent", "packet_nbytes", "read_packet", "to_bytes",
]
