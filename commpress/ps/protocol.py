"""Messages between parameter-server ranks: a fixed 48-byte header, then a payload.

Every message is one flat byte buffer; no pickle anywhere. Header (little-endian):

======  ====  ==============================================================
offset  size  field
======  ====  ==============================================================
0       4     ``magic``: ``b"CPPS"``
4       1     ``version``: 1
5       1     ``type``: :class:`MsgType`
6       2     ``flags``: bit 0 ``CRC`` (the crc32 field is valid; required unless the
              receiver allows device-buffer senders), bit 1 ``SKIP``
              (a push without payload: the worker's gradient was not finite)
8       4     ``shard``: the server's shard index
12      4     ``worker``: the worker index (sender of a push, receiver of a reply)
16      8     ``step``: the training step the message belongs to
24      8     ``nbytes``: payload length; must equal the received size minus 48
32      4     ``crc32``: zlib CRC-32 of the payload (when ``CRC`` is set)
36      4     ``reserved``: 0
40      8     ``value``: a finite float64 (the worker's loss on pushes to shard 0 when
              finite, else 0)
======  ====  ==============================================================

Payloads of ``PUSH``, ``UPDATE``, ``PARAMS`` and ``SHARD`` are the shard's segments in
order, each one packet in commpress's wire format: a :class:`commpress.wire.FrameLayout`
without flags (the frame container DDP uses too). The receiver knows every segment's codec,
size and seed from the shared :class:`~commpress.ps.sharding.Layout`, so it checks the total
length first, then each packet's header against its segment (codec, dtype, element count,
parameters, seed), then the packet's content, and only then decodes. ``PULL`` carries the
sender's 8-byte configuration fingerprint, ``STOP`` a UTF-8 reason, ``STATS`` UTF-8 JSON. Any
violation raises :class:`ProtocolError` naming the sender rank and the field.

Every constant both sides must agree on lives here: the header, the flags, the size limits,
:data:`BROADCAST`, :data:`JOIN_GRACE`, and the codec seed of each segment
(:func:`segment_seed`, built on :func:`commpress.rng.derive_seed`).
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

from .. import wire
from ..codecs import Codec, NoneCodec
from ..codecs.base import all_finite
from ..errors import CodecError, WireError
from ..rng import derive_seed
from ..wire.frame import FrameLayout
from ..wire.packet import Packet
from .errors import ProtocolError
from .sharding import Segment, Shard

MAGIC = b"CPPS"
VERSION = 1
HEADER = struct.Struct("<4sBBHIIQQIId")
HEADER_NBYTES = HEADER.size  # 48
FLAG_CRC = 1
FLAG_SKIP = 2
_KNOWN_FLAGS = FLAG_CRC | FLAG_SKIP
MAX_TEXT_NBYTES = 1024
MAX_STATS_NBYTES = 1 << 20
FINGERPRINT_NBYTES = 8
BROADCAST = 0xFFFFFFFF  #: ``worker`` field of a sync-mode reply that goes to every worker
JOIN_GRACE = 60.0  #: extra seconds a worker gets for its first message (imports, data loading)
DENSE = NoneCodec()  #: the codec of ``PARAMS``/``SHARD`` payloads and of uncompressed segments
PUSH_SEED, PULL_SEED = 1, 2  #: the ``kind`` of :func:`segment_seed`


def segment_seed(run_seed: int, kind: int, step: int, key: int, shard: int, segment: int) -> int:
    """Codec seed of one segment: ``derive_seed(run_seed, kind, step, key, shard, segment)``.

    ``kind`` is :data:`PUSH_SEED` (``key``: the pushing worker) or :data:`PULL_SEED` (``key``:
    the addressed worker, :data:`BROADCAST` in sync mode). Worker and server compute it
    independently; the receiver rejects a packet carrying another seed.
    """
    return derive_seed(run_seed, kind, step, key, shard, segment)


class MsgType(IntEnum):
    """Message types; the first three go worker -> server, the next three server -> worker."""

    PULL = 1    #: worker asks for the parameters (start, resume, end of training)
    PUSH = 2    #: worker's encoded gradient for one step and shard
    BYE = 3     #: worker is done (or acknowledges a STOP); no payload
    PARAMS = 4  #: server's parameters, dense (``none`` packets): the worker copies them
    UPDATE = 5  #: server's compressed update: the worker adds it to its copy
    STOP = 6    #: server tells a worker to stop (dropped, or the run is over); UTF-8 reason
    SHARD = 7   #: server -> rank 0 at the end: the final shard, dense
    STATS = 8   #: server -> rank 0 at the end: counters as UTF-8 JSON


TO_SERVER = frozenset({MsgType.PULL, MsgType.PUSH, MsgType.BYE})
TO_WORKER = frozenset({MsgType.PARAMS, MsgType.UPDATE, MsgType.STOP})
TO_ROOT = frozenset({MsgType.SHARD, MsgType.STATS})


@dataclass(frozen=True)
class Header:
    """A parsed, validated header."""

    type: MsgType
    flags: int
    shard: int
    worker: int
    step: int
    nbytes: int
    crc32: int
    value: float

    @property
    def skip(self) -> bool:
        """The push carries no gradient (non-finite on the worker)."""
        return bool(self.flags & FLAG_SKIP)


def build(
    mtype: MsgType,
    *,
    shard: int,
    worker: int,
    step: int,
    parts: Sequence[torch.Tensor | bytes] = (),
    value: float = 0.0,
    flags: int = 0,
    checksum: bool = True,
) -> torch.Tensor:
    """Assemble header + payload into one uint8 tensor (on the device of the tensor parts).

    With ``checksum`` the payload's CRC-32 is computed on the host, which needs the payload
    on the CPU; device buffers sent to a CUDA-aware MPI go without it (``checksum=False``).
    A non-finite ``value`` raises ValueError: the receiver would reject the message.
    """
    if not math.isfinite(value):
        raise ValueError(f"value must be finite (the receiver rejects anything else), got {value}")
    tensors = [p if isinstance(p, torch.Tensor) else torch.frombuffer(bytearray(p), dtype=torch.uint8)
               for p in parts if len(p)]
    device = tensors[0].device if tensors else torch.device("cpu")
    nbytes = sum(t.numel() for t in tensors)
    msg = torch.empty(HEADER_NBYTES + nbytes, dtype=torch.uint8, device=device)
    offset = HEADER_NBYTES
    for t in tensors:
        msg[offset : offset + t.numel()] = t.to(device)
        offset += t.numel()
    crc = 0
    if checksum:
        if device.type != "cpu":
            raise ValueError("checksum=True needs the payload on the CPU")
        crc = zlib.crc32(msg[HEADER_NBYTES:].numpy().data)
        flags |= FLAG_CRC
    head = HEADER.pack(MAGIC, VERSION, int(mtype), flags, shard, worker, step, nbytes, crc, 0, float(value))
    msg[:HEADER_NBYTES] = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(device)
    return msg


def parse_header(
    buf: np.ndarray, sender: int | None, allowed: frozenset[MsgType], *, require_crc: bool = True
) -> Header:
    """Validate the header of the received message ``buf`` (the whole message) and return it.

    Checks magic, version, type (one of ``allowed``), flags, reserved, the payload length
    against the received size and the payload's CRC-32. With ``require_crc`` (the default) a
    message whose sender cleared the ``CRC`` flag is rejected: the checksum is not optional on
    host transports. Pass False only for a sender that hands MPI device buffers (it cannot
    checksum them without the host copy it avoids). The CRC catches accidental corruption
    (a bad link, a truncated or mangled buffer); it is not authentication: any sender can
    compute a valid one.
    """
    n = len(buf)
    if n < HEADER_NBYTES:
        raise ProtocolError(f"truncated message: {n} bytes, the header alone needs {HEADER_NBYTES}", sender)
    magic, version, mtype, flags, shard, worker, step, nbytes, crc, reserved, value = HEADER.unpack_from(
        buf[:HEADER_NBYTES].tobytes()
    )
    if magic != MAGIC:
        raise ProtocolError(f"magic: expected {MAGIC!r}, got {magic!r}", sender)
    if version != VERSION:
        raise ProtocolError(f"version: unsupported protocol version {version} (this build speaks {VERSION})", sender)
    try:
        kind = MsgType(mtype)
    except ValueError:
        raise ProtocolError(f"type: unknown message type {mtype}", sender) from None
    if kind not in allowed:
        raise ProtocolError(f"type: {kind.name} is not accepted here", sender)
    if flags & ~_KNOWN_FLAGS:
        raise ProtocolError(f"flags: unknown bits {flags & ~_KNOWN_FLAGS:#x}", sender)
    if flags & FLAG_SKIP and kind != MsgType.PUSH:
        raise ProtocolError(f"flags: SKIP is only valid on PUSH, got {kind.name}", sender)
    if reserved != 0:
        raise ProtocolError(f"reserved: must be 0, got {reserved}", sender)
    if nbytes != n - HEADER_NBYTES:
        what = "truncated" if nbytes > n - HEADER_NBYTES else "oversized"
        raise ProtocolError(f"nbytes: {what} message, header declares {nbytes} payload bytes, got {n - HEADER_NBYTES}", sender)
    if not math.isfinite(value):
        raise ProtocolError(f"value: not finite ({value})", sender)
    if require_crc and not flags & FLAG_CRC:
        raise ProtocolError("flags: the CRC flag is cleared; this transport requires the payload's CRC-32", sender)
    if flags & FLAG_CRC:
        actual = zlib.crc32(np.ascontiguousarray(buf[HEADER_NBYTES:]).data)
        if actual != crc:
            raise ProtocolError(f"crc32: payload checksum {actual:#010x} does not match header {crc:#010x} (corrupted)", sender)
    return Header(kind, flags, shard, worker, step, nbytes, crc, value)


# ----- segment payloads ----------------------------------------------------------------------
CodecFor = Callable[[Segment], Codec]


def segment_layout(shard: Shard, codec_for: CodecFor, dtype: torch.dtype) -> FrameLayout:
    """The frame layout of a payload carrying every segment of ``shard`` (no flags)."""
    return FrameLayout(
        [(i, codec_for(seg), seg.numel) for i, seg in enumerate(shard.segments)], dtype,
        flags=False, what=f"shard {shard.index} payload", entry="segment",
    )


def payload_nbytes(shard: Shard, codec_for: CodecFor, dtype: torch.dtype) -> int:
    """Payload size of a message carrying every segment of ``shard``.

    Exact for fixed-size codecs, the largest possible with variable-length coding
    (e.g. ``qsgd:coding=gamma``).
    """
    return segment_layout(shard, codec_for, dtype).nbytes


def segment_parts(packets: Sequence[Packet]) -> list[torch.Tensor]:
    """Serialise segment packets (in segment order) for :func:`build`."""
    return [wire.to_bytes(p) for p in packets]


def parse_segments(
    payload: np.ndarray | torch.Tensor,
    shard: Shard,
    codec_for: CodecFor,
    dtype: torch.dtype,
    sender: int | None,
    *,
    seeds: Sequence[int] | None = None,
) -> list[Packet]:
    """Split and validate a segment payload; return one packet per segment (views into it).

    ``seeds``: the seed each segment's packet must carry (None: any). Nothing is decoded
    here, so a message that fails any check leaves no trace.
    """
    data = payload if isinstance(payload, torch.Tensor) else torch.from_numpy(payload)
    try:
        packets = segment_layout(shard, codec_for, dtype).unpack(data, seeds=seeds)
    except (WireError, CodecError) as exc:
        raise ProtocolError(str(exc), sender) from None
    return [p for p in packets if p is not None]  # no flags: never None


def decode_segments(
    packets: Sequence[Packet], shard: Shard, codec_for: CodecFor, out: torch.Tensor, sender: int | None
) -> torch.Tensor:
    """Decode validated segment packets into ``out`` (the shard's flat tensor, overwritten).

    Raises :class:`ProtocolError` (``out`` then holds garbage: decode into scratch space) if
    a decoded value is not finite.
    """
    for seg, packet in zip(shard.segments, packets):
        codec_for(seg).decode(packet, out[shard.local(seg)])
    if not all_finite(out):
        raise ProtocolError("payload decodes to non-finite values", sender)
    return out


def text_payload(text: str, limit: int = MAX_TEXT_NBYTES) -> bytes:
    """UTF-8 bytes of ``text`` cut to ``limit`` bytes (for STOP reasons)."""
    return text.encode("utf-8", "replace")[:limit]


def parse_text(payload: np.ndarray, sender: int | None, limit: int = MAX_TEXT_NBYTES) -> str:
    """Decode a UTF-8 payload of at most ``limit`` bytes."""
    if len(payload) > limit:
        raise ProtocolError(f"text payload of {len(payload)} bytes exceeds {limit}", sender)
    return payload.tobytes().decode("utf-8", "replace")
