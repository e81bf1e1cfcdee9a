"""One multi-packet container: several packets that travel as one flat byte buffer.

A DDP frame (one per rank and phase) and a parameter-server message payload are the same
thing: the packets of an ordered list of entries ``(key, codec, numel)`` of one dtype, which
the receiver knows in advance. :class:`FrameLayout` is built from that list on both sides and
owns the byte layout, the sizes and the validation:

=================  ============  =================================================================
part               size          content
=================  ============  =================================================================
header (``flags``)  8             ``b"CPFR"``, uint32 entry count (little-endian)
flags (``flags``)   count, to 8   one byte per entry: 0 packet follows, 1 no packet (the input was
                                  not finite); zero padding up to a multiple of 8
packets            per entry     one commpress wire packet per entry with a packet, in order
=================  ============  =================================================================

Without ``flags`` (a parameter-server payload: its message header already says "skip") the
frame is just the packets. A fixed-size codec's packet has exactly ``codec.wire_size`` bytes,
so a frame of fixed-size entries has one exact size that every rank knows without exchanging
it. A variable-size entry (``qsgd:coding=gamma``) takes what its own validated header says
(:func:`commpress.wire.format.read_packet`); the whole frame is then at most :attr:`nbytes`.

:meth:`FrameLayout.unpack` checks the size, the header and every packet's header against the
entry it must be (codec, dtype, element count, parameters, optionally the seed) *before* the
packet's content is read, and never decodes: a frame that fails any check leaves no trace.
Errors are :class:`~commpress.errors.WireError` naming the sender and the entry.
"""

from __future__ import annotations

import struct
from collections.abc import Hashable, Sequence

import torch

from ..errors import CodecError, WireError
from .format import Expect, read_packet, to_bytes
from .packet import Packet
from .registry import WireCodec

FRAME_MAGIC = b"CPFR"
_FRAME_HEAD = struct.Struct("<4sI")
FLAG_OK = 0
FLAG_NONFINITE = 1


def _align8(n: int) -> int:
    return (n + 7) // 8 * 8


class FrameLayout:
    """Byte layout of one frame of packets for ``entries`` ``(key, codec, numel)`` of ``dtype``.

    Args:
        entries: what the frame carries, in order; ``key`` names the entry in errors.
        dtype: dtype of every encoded tensor.
        flags: write the frame header and one flag per entry (DDP); without it (a
            parameter-server payload) the frame is the packets alone and every entry needs one.
        what: how errors name the frame (``"frame"``; ``"payload"`` for the parameter server).
        entry: how errors name an entry (``"slot"`` gives ``slot 'w'``, ``"segment"`` with
            integer keys ``segment 3``).

    Attributes: ``sizes`` (per entry: the exact packet size, the most for variable-size
    codecs), ``offsets`` (where each packet starts when every entry has its full size: exact
    when :attr:`fixed`), ``header_nbytes``, ``nbytes`` (exact when :attr:`fixed`, else the
    most a frame can take).
    """

    def __init__(
        self,
        entries: Sequence[tuple[Hashable, WireCodec, int]],
        dtype: torch.dtype,
        *,
        flags: bool = True,
        what: str = "frame",
        entry: str = "slot",
    ) -> None:
        self.keys = [k for k, _, _ in entries]
        self.codecs = [c for _, c, _ in entries]
        self.numels = [n for _, _, n in entries]
        self.dtype = dtype
        self.flags = flags
        self.what, self.entry = what, entry
        self.sizes = [c.wire_size(n, dtype) for _, c, n in entries]
        self.fixed = all(c.fixed_size for c in self.codecs)
        self.expects = [Expect.of(c, n, dtype) for _, c, n in entries]
        self.header_nbytes = _FRAME_HEAD.size + _align8(len(entries)) if flags else 0
        self.offsets: list[int] = []
        off = self.header_nbytes
        for size in self.sizes:
            self.offsets.append(off)
            off += size
        self.nbytes = off

    def __len__(self) -> int:
        return len(self.keys)

    def _label(self, i: int) -> str:
        return f"{self.entry} {self.keys[i]!r}"

    def _where(self, source: int | None) -> str:
        return self.what if source is None else f"{self.what} from rank {source}"

    # ----- sending ---------------------------------------------------------------------------
    def parts(self, packets: Sequence[Packet | None]) -> list[torch.Tensor]:
        """Serialise the packets (None: none) after checking each against its entry's size."""
        if len(packets) != len(self.sizes):
            raise CodecError(f"{self.what} has {len(self.sizes)} {self.entry}s, got {len(packets)} packets")
        out = []
        for i, (p, size, codec) in enumerate(zip(packets, self.sizes, self.codecs)):
            if p is None:
                if not self.flags:
                    raise CodecError(f"{self._label(i)}: a {self.what} without flags needs a packet for every entry")
                continue
            data = to_bytes(p)
            if data.numel() != size if codec.fixed_size else data.numel() > size:
                # would desynchronise every rank: never send it
                raise CodecError(f"{self._label(i)}: packet is {data.numel()} bytes, wire_size says {size}")
            out.append(data)
        return out

    def pack(
        self, packets: Sequence[Packet | None], out: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """Write the frame (into ``out``, zeroed first, if given; else a new tensor on ``device``).

        Returns ``out`` (or the new tensor) cut to the bytes used: :attr:`nbytes` for a
        :attr:`fixed` layout; a flagged entry's bytes then stay zero.
        """
        datas = self.parts(packets)
        if out is None:
            out = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        else:
            if out.numel() < self.nbytes:
                raise CodecError(f"{self.what}: out holds {out.numel()} bytes, the layout needs {self.nbytes}")
            out.zero_()
        if self.flags:
            flags = bytes(FLAG_NONFINITE if p is None else FLAG_OK for p in packets)
            head = _FRAME_HEAD.pack(FRAME_MAGIC, len(packets)) + flags
            out[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        it = iter(datas)
        off = self.header_nbytes
        for p, fixed_off in zip(packets, self.offsets):
            if self.fixed:
                off = fixed_off  # a flagged entry keeps its (zeroed) place
            if p is None:
                continue
            data = next(it)
            out[off : off + data.numel()] = data
            off += data.numel()
        return out if self.fixed else out[:off]

    # ----- receiving -------------------------------------------------------------------------
    def unpack(
        self, buf: torch.Tensor, source: int | None = None, *, seeds: Sequence[int] | None = None
    ) -> list[Packet | None]:
        """Parse a frame received from rank ``source``; None for flagged (non-finite) entries.

        Every packet must be what its entry expects (and carry ``seeds[i]`` when given), checked
        from its header before its content is read. Raises :class:`WireError` naming the rank
        and the entry when anything is off; nothing is decoded.
        """
        where = self._where(source)
        n = buf.numel()
        if n != self.nbytes if self.fixed else n > self.nbytes or n < self.header_nbytes:
            raise WireError(
                f"{where}: {n} bytes, the layout needs {'exactly' if self.fixed else 'at most'} {self.nbytes} "
                f"({len(self.sizes)} {self.entry}s)"
            )
        if seeds is not None and len(seeds) != len(self.sizes):
            raise CodecError(f"{self.what}: {len(seeds)} seeds for {len(self.sizes)} {self.entry}s")
        flags = bytes(len(self.sizes))
        if self.flags:
            head = bytes(buf[: self.header_nbytes].cpu().numpy().tobytes())
            magic, count = _FRAME_HEAD.unpack_from(head)
            if magic != FRAME_MAGIC or count != len(self.sizes):
                raise WireError(
                    f"{where}: bad header (magic {magic!r}, {count} {self.entry}s, "
                    f"expected {FRAME_MAGIC!r}, {len(self.sizes)}): ranks disagree on the layout"
                )
            flags = head[_FRAME_HEAD.size : _FRAME_HEAD.size + len(self.sizes)]
        out: list[Packet | None] = []
        off = self.header_nbytes
        for i, (expect, size, fixed_off) in enumerate(zip(self.expects, self.sizes, self.offsets)):
            if self.fixed:
                off = fixed_off
            flag = flags[i]
            if flag == FLAG_NONFINITE:
                out.append(None)
                continue
            if flag != FLAG_OK:
                raise WireError(f"{where}: {self._label(i)} has unknown flag {flag}")
            if seeds is not None:
                expect = expect._replace(seed=seeds[i])
            # a fixed-size entry gets exactly its bytes; a variable one at most its maximum
            end = off + size
            try:
                p, used = read_packet(buf[off:end], expect, trailing=not self.codecs[i].fixed_size)
            except WireError as exc:
                raise WireError(f"{where}, {self._label(i)}: {exc}") from None
            out.append(p)
            off += used
        if not self.fixed and off != n:
            raise WireError(f"{where}: {n - off} bytes after the last {self.entry}")
        return out


__all__ = ["FLAG_NONFINITE", "FLAG_OK", "FRAME_MAGIC", "FrameLayout"]
