"""``qsgd``: stochastic quantisation to s levels per bucket (Alistarh et al., 2017).

Every element of a bucket of ``bucket_size`` is mapped to a signed level in ``[-s, s]`` by
stochastic rounding against the bucket's L2 norm; decode is ``x_i' = n_b * (q_i / s)``. The
exact arithmetic (24-bit fixed point, the shared RNG, the bias bound) is the specification in
:mod:`commpress.spec.qsgd`.

Kernels: ``encode_reference`` / ``decode_reference`` (:mod:`commpress.spec.qsgd`) are the specification;
``commpress.kernels.ops.qsgd_encode`` / ``qsgd_decode`` run the native CPU/CUDA kernels when built,
bit-identical to them (same seed, same bytes on every backend).
:meth:`QSGDCodec.encode_with_feedback` fuses error feedback into the encode.

Properties: unbiased, ``E[C(x)] = x``; variance per bucket of d elements
``E||C(x) - x||^2 <= min(d / s^2, sqrt(d) / s) * ||x||^2`` (QSGD, Lemma 3.1).

Wire: ``norms`` (one per bucket) then ``levels``; ``param0 = bits | s << 8 | coding << 16``,
``param1 = bucket_size``. With ``coding="fixed"`` (0, the default) ``levels`` holds the packed
``bits``-wide fields. With ``coding="gamma"`` (1) it holds the Elias-gamma stream of the same
levels (:mod:`commpress.spec.varlen`): the decoded tensor is identical, the packet smaller (about 1.5
to 2 bits per element instead of 4 at ``bits=4`` on real gradients) and variable in size, so
it suits the parameter server (one message per worker) but not DDP's fixed-size collectives.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CodecError, WireError
from ..kernels import ops
from ..spec import varlen
from ..spec.bitpack import packed_nbytes, padding_is_zero
from ..spec.qsgd import (
    FRACTION_BITS,
    QSGD_BITS,
    bucket_norms,
    decode_reference,
    encode_reference,
    max_levels,
)
from ..wire.packet import Packet, Section
from .base import Codec, check_scales, scale_dtype

__all__ = [
    "CODINGS", "FRACTION_BITS", "QSGD_BITS", "QSGDCodec", "bucket_norms", "decode_reference", "encode_reference",
    "max_levels",
]

#: ``coding`` option -> its code in ``param0 >> 16``
CODINGS = {"fixed": 0, "gamma": 1}


class QSGDCodec(Codec):
    """QSGD with ``bits`` in {2, 4, 8}; ``levels`` defaults to the most the width allows."""

    name = "qsgd"
    codec_id = 7
    reencodable = True
    unbiased = True
    stochastic = True

    def __init__(
        self, bits: int = 4, levels: int | None = None, bucket_size: int = 512, coding: str = "fixed"
    ) -> None:
        if coding not in CODINGS:
            raise CodecError(f"qsgd: coding must be one of {', '.join(CODINGS)}, got {coding!r}")
        if bits not in QSGD_BITS:
            raise CodecError(f"qsgd: bits must be one of {QSGD_BITS}, got {bits!r}")
        top = max_levels(bits)
        if levels is None:
            levels = top
        if not isinstance(levels, int) or isinstance(levels, bool) or not 1 <= levels <= top:
            raise CodecError(f"qsgd: levels must be an int in [1, {top}] for bits={bits}, got {levels!r}")
        if not isinstance(bucket_size, int) or isinstance(bucket_size, bool) or not 1 <= bucket_size < 1 << 32:
            raise CodecError(f"qsgd: bucket_size must be an int in [1, 2**32), got {bucket_size!r}")
        self.bits = bits
        self.levels = levels
        self.bucket_size = bucket_size
        self.coding = coding

    @property
    def fixed_size(self) -> bool:
        """False with ``coding="gamma"``: the packet size depends on the data."""
        return self.coding == "fixed"

    def block_alignment(self) -> int:
        """One norm per ``bucket_size`` elements: pieces are cut on bucket boundaries."""
        return self.bucket_size

    def config(self) -> dict[str, Any]:
        """Return ``{"name": "qsgd", "bits", "levels", "bucket_size"}``, plus ``coding`` unless fixed."""
        cfg: dict[str, Any] = {"name": self.name, "bits": self.bits, "levels": self.levels, "bucket_size": self.bucket_size}
        if self.coding != "fixed":
            cfg["coding"] = self.coding
        return cfg

    def variance_bound(self, numel: int) -> float:
        """``min(d/s^2, sqrt(d)/s)`` with d the bucket length: E||C(x)-x||^2 <= this * ||x||^2."""
        d = min(numel, self.bucket_size)
        s = self.levels
        return min(d / s**2, d**0.5 / s)

    def wire_params(self, numel: int) -> tuple[int, int]:
        """``(bits | levels << 8 | coding << 16, bucket_size)``."""
        return (self.bits | self.levels << 8 | CODINGS[self.coding] << 16, self.bucket_size)

    @staticmethod
    def unpack_params(params: tuple[int, int]) -> tuple[int, int, int]:
        """Return ``(bits, levels, bucket_size)`` from header parameters."""
        return params[0] & 0xFF, (params[0] >> 8) & 0xFF, params[1]

    @staticmethod
    def is_gamma(params: tuple[int, int]) -> bool:
        """True when the header parameters say ``coding="gamma"``."""
        return params[0] >> 16 == CODINGS["gamma"]

    @classmethod
    def check_wire_params(cls, numel: int, params: tuple[int, int]) -> None:
        """Bits in {2, 4, 8}, levels in [1, 2**(bits-1) - 1], bucket size in [1, 2**32), known coding."""
        if params[0] >> 16 not in CODINGS.values():
            raise WireError(f"params.coding: must be one of {sorted(CODINGS.values())}, got {params[0] >> 16}")
        bits, levels, bucket = cls.unpack_params(params)
        if bits not in QSGD_BITS:
            raise WireError(f"params.bits: must be one of {QSGD_BITS}, got {bits}")
        if not 1 <= levels <= max_levels(bits):
            raise WireError(f"params.levels: must be in [1, {max_levels(bits)}] for bits={bits}, got {levels}")
        if not 1 <= bucket < 1 << 32:
            raise WireError(f"params.bucket_size: must be in [1, 2**32), got {bucket}")

    @classmethod
    def layout(cls, numel: int, dtype: torch.dtype, params: tuple[int, int]) -> list[Section]:
        """``norms`` (one per bucket) and ``levels`` (numel packed fields, or their gamma stream)."""
        bits, s, bucket = cls.unpack_params(params)
        norms = Section("norms", scale_dtype(dtype), -(-numel // bucket))
        if cls.is_gamma(params):
            return [norms, Section("levels", torch.uint8, varlen.max_nbytes(numel, s), variable=True)]
        return [norms, Section("levels", torch.uint8, packed_nbytes(numel, bits))]

    @classmethod
    def check_content(cls, packet: Packet) -> None:
        """Norms finite and >= 0; every field <= 2s; padding bits zero."""
        bits, levels, _ = cls.unpack_params(packet.params)
        check_scales(packet, "norms")
        if cls.is_gamma(packet.params):
            varlen.decode(packet.sections["levels"], packet.numel, levels)  # raises if malformed
            return
        packed = packet.sections["levels"]
        if not padding_is_zero(packed, bits, packet.numel):
            raise WireError("section 'levels': padding bits of the last byte are not zero")
        if bits < 8 and 2 * levels >= (1 << bits) - 1:
            return  # every representable field is a valid level
        fields = ops.unpack_bits(packed, bits, packet.numel)
        if fields.numel() and int(fields.max()) > 2 * levels:
            raise WireError(f"section 'levels': field {int(fields.max())} exceeds 2*levels = {2 * levels}")

    def _encode(self, flat: torch.Tensor, params: tuple[int, int], seed: int) -> dict[str, torch.Tensor]:
        bits, s, bucket = self.unpack_params(params)
        norms, levels = ops.qsgd_encode(flat, bits, s, bucket, seed)
        return {"norms": norms, "levels": self._code(levels, flat.numel())}

    def _code(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
        """The ``levels`` section: the packed fields, or their gamma stream."""
        if self.coding == "fixed":
            return packed
        return varlen.encode(ops.unpack_bits(packed, self.bits, numel), self.levels)

    _decode_writes = True

    def _decode_add(self, packet: Packet, out: torch.Tensor) -> None:
        self._decode_into(packet, out, True)

    def _decode_into(self, packet: Packet, out: torch.Tensor, accumulate: bool) -> None:
        bits, s, bucket = self.unpack_params(packet.params)
        packed = packet.sections["levels"]
        if self.is_gamma(packet.params):
            packed = ops.pack_bits(varlen.decode(packed, packet.numel, s), bits)
        ops.qsgd_decode(packet.sections["norms"], packed, bits, s, bucket, out, accumulate)

    has_fused_feedback = True

    def _encode_fused(
        self, flat: torch.Tensor, params: tuple[int, int], seed: int, residual: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        bits, s, bucket = self.unpack_params(params)
        norms, levels = ops.qsgd_encode(flat, bits, s, bucket, seed, residual=residual)
        return {"norms": norms, "levels": self._code(levels, flat.numel())}
