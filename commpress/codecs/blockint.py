"""``int8`` and ``int4``: block-scaled symmetric integers, deterministic (ZeRO++ qwZ style).

Every block of ``block_size`` elements (default 256) gets one scale ``absmax / q_max``
(``q_max`` = 127 for int8, 7 for int4) and each element the nearest level ``q`` in
``[-q_max, q_max]``, rounded half to even; decode is ``q * scale``. The arithmetic, the error
bound (half a step: ``|x' - x| <= scale / 2`` up to the roundings stated there), zero blocks,
exact grid values and idempotence are the specification in :mod:`commpress.spec.blockint`;
the encode and decode run the fast path :mod:`commpress.kernels.blockint` (the native kernels
where built, else vectorised torch), bit for bit the specification.

Made for the FSDP parameter all-gather (``commpress.fsdp.register(..., param_codec="int8")``):
parameters need a bounded per-element error and the same bytes for the same input on every
rank, not an unbiased estimate, which is why this is not ``qsgd`` (stochastic rounding against
an L2 norm). Usable for gradients too (biased; error feedback is on by default there).

Wire: ``scales`` (one per block, float32, float64 for float64 input) then ``fields``
(``q + q_max`` packed LSB-first, 8 or 4 bits each; int4 holds two per byte);
``param0 = block_size``, ``param1 = 0``. Size: ``4 * ceil(d / B) + ceil(d * bits / 8)`` bytes
of payload, plus the 40-byte packet header and padding to 8 bytes: ``wire_size``. For float32
at B = 256 that is 3.94x smaller (int8) and 7.76x (int4).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..errors import CodecError, WireError
from ..kernels import blockint as fast
from ..kernels import ops
from ..spec.bitpack import packed_nbytes, padding_is_zero
from ..spec.blockint import (
    DEFAULT_BLOCK,
    QMAX,
    check_decodable,
    decode_reference,
    encode_reference,
    n_blocks,
)
from ..wire.packet import Packet, Section
from .base import Codec, check_scales, scale_dtype

__all__ = ["DEFAULT_BLOCK", "Int4Codec", "Int8Codec", "decode_reference", "encode_reference"]

#: Block sizes accepted (the wire's param0; a block needs at least one element).
MAX_BLOCK = 1 << 31


class _BlockIntCodec(Codec):
    """What int8 and int4 share: one scale per block, fixed-width level fields."""

    bits: ClassVar[int]
    reencodable = True
    _decode_writes = True

    def __init__(self, block_size: int = DEFAULT_BLOCK) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or not 1 <= block_size < MAX_BLOCK:
            raise CodecError(f"{self.name}: block_size must be an int in [1, 2**31), got {block_size!r}")
        self.block_size = block_size

    @property
    def qmax(self) -> int:
        """Largest level magnitude (127 or 7)."""
        return QMAX[self.bits]

    def block_alignment(self) -> int:
        """One scale per ``block_size`` elements: pieces are cut on block boundaries."""
        return self.block_size

    def config(self) -> dict[str, Any]:
        """Return ``{"name": "int8"|"int4", "block_size": ...}``."""
        return {"name": self.name, "block_size": self.block_size}

    def wire_params(self, numel: int) -> tuple[int, int]:
        """``(block_size, 0)``."""
        return (self.block_size, 0)

    @classmethod
    def check_wire_params(cls, numel: int, params: tuple[int, int]) -> None:
        """``param0`` (the block size) in [1, 2**31); ``param1`` must be 0."""
        if not 1 <= params[0] < MAX_BLOCK:
            raise WireError(f"params[0]: {cls.name} block_size must be in [1, 2**31), got {params[0]}")
        if params[1] != 0:
            raise WireError(f"params[1]: must be 0 for {cls.name}, got {params[1]}")

    @classmethod
    def layout(cls, numel: int, dtype: torch.dtype, params: tuple[int, int]) -> list[Section]:
        """``scales`` (one per block) and ``fields`` (``ceil(numel * bits / 8)`` bytes)."""
        return [
            Section("scales", scale_dtype(dtype), n_blocks(numel, params[0])),
            Section("fields", torch.uint8, packed_nbytes(numel, cls.bits)),
        ]

    @classmethod
    def check_content(cls, packet: Packet) -> None:
        """Scales finite, >= 0, ``q_max * scale`` finite in the packet's dtype; fields <= 2 q_max; padding zero."""
        check_scales(packet, "scales")
        if not check_decodable(packet.sections["scales"], cls.bits, packet.dtype):
            raise WireError(f"section 'scales': {QMAX[cls.bits]} * scale overflows {packet.dtype} (the decode would)")
        packed = packet.sections["fields"]
        if not padding_is_zero(packed, cls.bits, packet.numel):
            raise WireError("section 'fields': padding bits of the last byte are not zero")
        fields = packed if cls.bits == 8 else ops.unpack_bits(packed, cls.bits, packet.numel)
        if fields.numel() and int(fields.max()) > 2 * QMAX[cls.bits]:
            raise WireError(f"section 'fields': field {int(fields.max())} exceeds 2*q_max = {2 * QMAX[cls.bits]}")

    def _encode(self, flat: torch.Tensor, params: tuple[int, int], seed: int) -> dict[str, torch.Tensor]:
        scales, fields = fast.encode(flat, self.bits, self.block_size)
        return {"scales": scales, "fields": fields}

    def _decode_add(self, packet: Packet, out: torch.Tensor) -> None:
        self._decode_into(packet, out, True)

    def _decode_into(self, packet: Packet, out: torch.Tensor, accumulate: bool) -> None:
        s = packet.sections
        fast.decode(s["scales"], s["fields"], self.bits, packet.params[0], out, accumulate)


class Int8Codec(_BlockIntCodec):
    """8-bit levels in [-127, 127] and one scale per block: ~1 byte per element."""

    name = "int8"
    codec_id = 8
    bits = 8


class Int4Codec(_BlockIntCodec):
    """4-bit levels in [-7, 7] and one scale per block: ~half a byte per element."""

    name = "int4"
    codec_id = 9
    bits = 4
