"""Packet <-> bytes: commpress's versioned, self-describing, strictly validated wire format.

Every compressed tensor travels as one flat ``uint8`` buffer (all integers little-endian):

=======  ======  =============================================================
offset   size    field
=======  ======  =============================================================
0        4       ``magic``: ``b"CPRS"``
4        1       ``version``: format version, currently 1
5        1       ``codec_id``: which codec (:mod:`.registry`; ``commpress.codecs.available()``)
6        1       ``dtype``: dtype of the encoded tensor (1 fp32, 2 fp16, 3 bf16, 4 fp64)
7        1       ``nsections``: number of sections that follow
8        8       ``numel``: element count of the encoded tensor
16       8       ``seed``: seed of the codec's counter-based RNG (``commpress.rng``)
24       8       ``param0``: first codec parameter (e.g. k for top-k)
32       8       ``param1``: second codec parameter (e.g. bucket size for QSGD)
40       8 * n   ``length[i]``: byte length of section i (padding excluded)
...              sections in the codec's order, each starting 8-byte aligned and
                 zero-padded to a multiple of 8 bytes
=======  ======  =============================================================

The codec id, ``numel`` and the two parameters fully determine every section's dtype and
length, so the declared lengths are redundant on purpose: :func:`from_bytes` checks them
against what the codec expects *before* it touches the payload, then checks the total size,
the zero padding and the codec's own content rules (sorted in-range top-k indices, level
fields within range, finite non-negative scales). The one exception is a codec option with
variable-length coding (e.g. ``qsgd`` with ``coding="gamma"``): its coded section declares
its own length, checked against the most the codec can produce, and the packet's size is known
from its header (:func:`packet_extent`), so packets can be concatenated in one message. Any violation raises
:class:`commpress.WireError` naming the field; nothing is ever read outside the buffer and no
allocation is sized from an unchecked header field. No pickle is involved anywhere.

How big a tensor a packet may describe (``numel``, which sizes the decoded tensor) is decided
by the receiver, never by the header: with an :class:`Expect` the header must say exactly the
expected element count (checked before anything else). Without one, ``numel`` is believed only
up to ``max(max_numel, 8 * len(buf))``: a dense codec needs at least one bit per element, so
its packets always pass, while a sparse packet (top-k, random-k: a few values standing for
many elements) may describe at most ``max_numel`` elements, :data:`MAX_NUMEL` (2**24, a
128 MiB float64 tensor) unless the caller raises it. A 56-byte random-k packet can therefore no
longer make its receiver allocate gigabytes.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..errors import CodecError, WireError
from . import registry
from .packet import FLOAT_DTYPE_CODES, Packet, Section
from .registry import WireCodec

MAGIC = b"CPRS"
VERSION = 1
ALIGN = 8
_HEADER = struct.Struct("<4sBBBBQQQQ")
HEADER_NBYTES = _HEADER.size  # 40
#: Most elements a packet read without an :class:`Expect` may describe beyond what its bytes
#: back (8 elements per received byte); see the module docstring.
MAX_NUMEL = 1 << 24
_DTYPE_BY_CODE = {code: dt for dt, code in FLOAT_DTYPE_CODES.items()}

if sys.byteorder != "little":  # sections are copied as raw native-endian bytes
    raise ImportError("commpress.wire supports little-endian hosts only")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def packet_nbytes(layout: Sequence[Section]) -> int:
    """Return the wire size of a packet whose sections are ``layout``.

    Exact when no section is variable; otherwise the largest size such a packet can have.
    """
    return HEADER_NBYTES + ALIGN * len(layout) + sum(_align(s.nbytes) for s in layout)


class Expect(NamedTuple):
    """What a receiver knows a packet must be: compared with its header before anything else.

    A receiver always knows which tensor it is waiting for, so nothing read from the bytes
    (a codec, a parameter, an element count that sizes a buffer) is trusted before it has been
    found equal to this. ``seed`` None: any seed.
    """

    codec: str
    dtype: torch.dtype
    numel: int
    params: tuple[int, int]
    seed: int | None = None

    @classmethod
    def of(cls, codec: WireCodec, numel: int, dtype: torch.dtype, seed: int | None = None) -> Expect:
        """The expectation for ``codec`` encoding ``numel`` elements of ``dtype``."""
        return cls(codec.name, dtype, numel, codec.wire_params(numel), seed)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def to_bytes(packet: Packet) -> torch.Tensor:
    """Serialise ``packet`` into one flat uint8 tensor on the packet's device."""
    cls = registry.by_name(packet.codec)
    layout = cls.layout(packet.numel, packet.dtype, packet.params)
    names = [s.name for s in layout]
    if list(packet.sections) != names:
        raise CodecError(f"packet sections {list(packet.sections)} do not match codec layout {names}")
    for i, section in enumerate(layout):
        if section.variable:
            t = packet.sections[section.name]
            if t.dtype != section.dtype or t.numel() > section.numel:
                raise CodecError(
                    f"section {section.name!r} holds {t.numel()} x {t.dtype}, "
                    f"layout allows at most {section.numel} x {section.dtype}"
                )
            layout[i] = section._replace(numel=t.numel())
    header = _HEADER.pack(
        MAGIC, VERSION, cls.codec_id, FLOAT_DTYPE_CODES[packet.dtype], len(layout),
        packet.numel, packet.seed, packet.params[0], packet.params[1],
    ) + b"".join(struct.pack("<Q", s.nbytes) for s in layout)
    out = torch.zeros(packet_nbytes(layout), dtype=torch.uint8, device=packet.device)
    out[: len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    offset = len(header)
    for section in layout:
        t = packet.sections[section.name]
        if t.dtype != section.dtype or t.numel() != section.numel:
            raise CodecError(
                f"section {section.name!r} holds {t.numel()} x {t.dtype}, "
                f"layout needs {section.numel} x {section.dtype}"
            )
        out[offset : offset + section.nbytes] = t.reshape(-1).view(torch.uint8)
        offset += _align(section.nbytes)
    return out


def _as_uint8(buf: torch.Tensor | bytes | bytearray | memoryview) -> torch.Tensor:
    if isinstance(buf, torch.Tensor):
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise WireError(f"buffer must be a 1-D uint8 tensor, got {buf.dtype} {tuple(buf.shape)}")
        return buf.contiguous()
    if isinstance(buf, (bytes, bytearray, memoryview)):
        data = bytearray(buf)
        if not data:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(data, dtype=torch.uint8)
    raise WireError(f"buffer must be a uint8 tensor or bytes, got {type(buf).__name__}")


def _view(buf: torch.Tensor, offset: int, section: Section) -> torch.Tensor:
    raw = buf[offset : offset + section.nbytes]
    if section.dtype == torch.uint8:
        return raw
    if raw.storage_offset() % raw.new_empty((), dtype=section.dtype).element_size():
        raw = raw.clone()  # misaligned caller buffer: copy once rather than fail
    return raw.view(section.dtype)


def _check_expected(expect: Expect, name: str, dtype: torch.dtype, numel: int, params: tuple[int, int], seed: int) -> None:
    for field, got, want in (("codec", name, expect.codec), ("dtype", dtype, expect.dtype),
                             ("numel", numel, expect.numel), ("params", params, expect.params)):
        if got != want:
            raise WireError(f"{field}: got {got!r}, expected {want!r}")
    if expect.seed is not None and seed != expect.seed:
        raise WireError(f"seed: got {seed}, expected {expect.seed}")


def _check_numel(numel: int, total: int, max_numel: int) -> None:
    """Without an expectation: ``numel`` at most ``max_numel`` or 8 per received byte."""
    if numel > max_numel and numel > 8 * total:
        raise WireError(
            f"numel: header claims {numel} elements in a {total}-byte buffer; without an expected "
            f"tensor a packet may describe at most max(max_numel={max_numel}, 8 per byte received) "
            "(pass expect=, or a larger max_numel)"
        )


def _parse_head(
    data: torch.Tensor, expect: Expect | None = None, max_numel: int = MAX_NUMEL
) -> tuple[type[WireCodec], torch.dtype, int, int, tuple[int, int], list[Section]]:
    """Validate a packet's header and section table; return what they say.

    Returns ``(codec class, dtype, numel, seed, params, layout)`` with the layout's variable
    sections set to their declared lengths. Reads only the header and the table. With
    ``expect`` the header must say exactly that, checked before any size is computed from it;
    without, ``numel`` is bounded as the module docstring says.
    """
    total = data.numel()
    if total < HEADER_NBYTES:
        raise WireError(f"truncated: the header needs {HEADER_NBYTES} bytes, got {total}")
    head = bytes(data[:HEADER_NBYTES].cpu().numpy().tobytes())
    magic, version, codec_id, dtype_code, nsections, numel, seed, p0, p1 = _HEADER.unpack(head)
    if magic != MAGIC:
        raise WireError(f"magic: expected {MAGIC!r}, got {magic!r}")
    if version != VERSION:
        raise WireError(f"version: unsupported wire version {version} (this build reads {VERSION})")
    cls = registry.by_id(codec_id)
    if cls is None:
        raise WireError(f"codec_id: unknown codec id {codec_id}")
    dtype = _DTYPE_BY_CODE.get(dtype_code)
    if dtype is None:
        raise WireError(f"dtype: unknown dtype code {dtype_code}")
    params = (p0, p1)
    if expect is not None:
        _check_expected(expect, cls.name, dtype, numel, params, seed)
    cls.check_wire_params(numel, params)  # raises WireError naming the parameter
    layout = cls.layout(numel, dtype, params)
    if nsections != len(layout):
        raise WireError(f"nsections: codec {cls.name!r} has {len(layout)} sections, header says {nsections}")
    table_end = HEADER_NBYTES + ALIGN * nsections
    if total < table_end:
        raise WireError(f"truncated: the section table needs {table_end} bytes, got {total}")
    table = data[HEADER_NBYTES:table_end].cpu().numpy().tobytes()
    for i, section in enumerate(layout):
        (declared,) = struct.unpack_from("<Q", table, 8 * i)
        if section.variable and declared <= section.nbytes and declared % _itemsize(section.dtype) == 0:
            layout[i] = section._replace(numel=declared // _itemsize(section.dtype))
        elif declared != section.nbytes:
            most = "at most " if section.variable else ""
            raise WireError(
                f"length[{i}] ({section.name}): header says {declared} bytes, "
                f"codec {cls.name!r} with numel={numel} needs {most}{section.nbytes}"
            )
    if expect is None:  # sizes so far were plain integer arithmetic: nothing allocated yet
        _check_numel(numel, total, max_numel)
    return cls, dtype, numel, seed, params, layout


def packet_extent(
    buf: torch.Tensor | bytes | bytearray | memoryview, expect: Expect | None = None, *, max_numel: int = MAX_NUMEL
) -> int:
    """Size in bytes of the packet that starts ``buf`` (read from its validated header).

    ``buf`` may continue past the packet (several packets in one message); only the header and
    section table are read. Raises :class:`WireError` like :func:`from_bytes`.
    """
    data = _as_uint8(buf)
    return packet_nbytes(_parse_head(data, expect, max_numel)[5])


def from_bytes(
    buf: torch.Tensor | bytes | bytearray | memoryview, expect: Expect | None = None, *, max_numel: int = MAX_NUMEL
) -> Packet:
    """Parse and validate one packet; raise :class:`WireError` naming the first bad field.

    With ``expect`` the header must describe exactly the expected tensor (checked first, so
    no allocation or decode is ever sized by an unexpected header). Without it the packet may
    describe at most ``max(max_numel, 8 * len(buf))`` elements (see the module docstring).
    The returned sections are views into ``buf`` where alignment allows (zero copy). A packet
    that passes decodes to finite values in its dtype.
    """
    return read_packet(buf, expect, trailing=False, max_numel=max_numel)[0]


def read_packet(
    buf: torch.Tensor | bytes | bytearray | memoryview,
    expect: Expect | None = None,
    *,
    trailing: bool = True,
    max_numel: int = MAX_NUMEL,
) -> tuple[Packet, int]:
    """Parse the packet that starts ``buf``; return it and its size in bytes.

    With ``trailing`` (the default) ``buf`` may continue past the packet: that is how several
    variable-size packets are read back from one message (:mod:`commpress.wire.frame`).
    ``expect`` and ``max_numel`` as in :func:`from_bytes`.
    """
    data = _as_uint8(buf)
    total = data.numel()
    cls, dtype, numel, seed, params, layout = _parse_head(data, expect, max_numel)
    table_end = HEADER_NBYTES + ALIGN * len(layout)
    expected = packet_nbytes(layout)
    if total < expected:
        raise WireError(f"truncated: packet needs {expected} bytes, got {total}")
    if total > expected and not trailing:
        raise WireError(f"oversized: packet is {expected} bytes, got {total} (trailing data)")
    sections: dict[str, torch.Tensor] = {}
    offset = table_end
    for section in layout:
        end = offset + section.nbytes
        pad_end = offset + _align(section.nbytes)
        if pad_end > end and bool(data[end:pad_end].any()):
            raise WireError(f"padding after section {section.name!r} is not zero")
        sections[section.name] = _view(data, offset, section)
        offset = pad_end
    packet = Packet(cls.name, dtype, numel, params, seed, sections)
    cls.check_content(packet)  # raises WireError naming the section
    return packet, expected
