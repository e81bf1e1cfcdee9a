"""``sign``: 1 bit per element plus one scale per block (EF-signSGD, Karimireddy et al. 2019).

Encoding: bit i is 1 when ``x_i < 0`` and 0 otherwise (so 0 and -0.0 both decode to +scale);
the block's scale is its mean magnitude ``||x_b||_1 / L_b`` (accumulated in float64 in the fixed
order of :func:`commpress.spec.numerics.tree_sum`, divided by ``L_b`` in float64, stored as
float32, or float64 for float64 input). ``block_size=0`` means one block for the whole tensor.
Decoding adds ``+-scale`` (in float32, or float64) rounded to the output dtype.

Kernels: ``encode_reference`` / ``decode_reference`` (:mod:`commpress.spec.sign`) are the specification;
``commpress.kernels.ops.sign_encode`` / ``sign_decode`` run the native CPU/CUDA kernels when built,
bit-identical to them. :meth:`SignCodec.encode_with_feedback` fuses error feedback into the
encode (one kernel reads g and e, writes the bits, the scales and the new e).

Properties: deterministic, biased, contractive: the mean magnitude is the scale that minimises
the error, leaving ``||C(x) - x||^2 = ||x||^2 - ||x||_1^2 / L <= (1 - 1/L) ||x||^2`` per block,
so ``delta = 1 / L`` with L the largest block length.

Wire: ``scales`` (one per block) then ``bits`` (ceil(d/8) bytes, LSB-first, zero padding);
``param0 = block_size``. About 1 bit per element: a 32x reduction for float32.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CodecError, WireError
from ..kernels import ops
from ..spec.bitpack import packed_nbytes, padding_is_zero
from ..spec.sign import decode_reference, encode_reference, n_blocks
from ..wire.packet import Packet, Section
from .base import Codec, check_scales, scale_dtype

__all__ = ["MAX_BLOCK", "SignCodec", "decode_reference", "encode_reference", "n_blocks"]

#: Block sizes must fit the kernels' int64 (any size >= the tensor's length is one block).
MAX_BLOCK = 1 << 63


class SignCodec(Codec):
    """Scaled 1-bit sign compression; ``block_size`` elements share one scale (0 = whole tensor)."""

    name = "sign"
    codec_id = 6
    reencodable = True

    def block_alignment(self) -> int:
        """One scale per ``block_size`` elements: pieces are cut on block boundaries."""
        return self.block_size or 1

    def __init__(self, block_size: int = 0) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or not 0 <= block_size < MAX_BLOCK:
            raise CodecError(f"sign: block_size must be an int in [0, 2**63), got {block_size!r}")
        self.block_size = block_size

    def config(self) -> dict[str, Any]:
        """Return ``{"name": "sign", "block_size": ...}``."""
        return {"name": self.name, "block_size": self.block_size}

    def delta(self, numel: int) -> float:
        """``1 / L`` with L the longest block."""
        if numel == 0:
            return 1.0
        return 1.0 / (numel if self.block_size == 0 else min(numel, self.block_size))

    def wire_params(self, numel: int) -> tuple[int, int]:
        """``(block_size, 0)``."""
        return (self.block_size, 0)

    @classmethod
    def check_wire_params(cls, numel: int, params: tuple[int, int]) -> None:
        """``param0`` (the block size) below 2**63, like the codec's; ``param1`` must be 0."""
        if not 0 <= params[0] < MAX_BLOCK:
            raise WireError(f"params[0]: sign block_size must be < 2**63, got {params[0]}")
        if params[1] != 0:
            raise WireError(f"params[1]: must be 0 for sign, got {params[1]}")

    @classmethod
    def layout(cls, numel: int, dtype: torch.dtype, params: tuple[int, int]) -> list[Section]:
        """``scales`` (one per block) and ``bits`` (ceil(numel / 8) bytes)."""
        return [
            Section("scales", scale_dtype(dtype), n_blocks(numel, params[0])),
            Section("bits", torch.uint8, packed_nbytes(numel, 1)),
        ]

    @classmethod
    def check_content(cls, packet: Packet) -> None:
        """Scales finite and >= 0; padding bits of the last byte zero."""
        check_scales(packet, "scales")
        if not padding_is_zero(packet.sections["bits"], 1, packet.numel):
            raise WireError("section 'bits': padding bits of the last byte are not zero")

    def _encode(self, flat: torch.Tensor, params: tuple[int, int], seed: int) -> dict[str, torch.Tensor]:
        scales, bits = ops.sign_encode(flat, params[0])
        return {"scales": scales, "bits": bits}

    _decode_writes = True

    def _decode_add(self, packet: Packet, out: torch.Tensor) -> None:
        self._decode_into(packet, out, True)

    def _decode_into(self, packet: Packet, out: torch.Tensor, accumulate: bool) -> None:
        ops.sign_decode(packet.sections["scales"], packet.sections["bits"], packet.params[0], out, accumulate)

    has_fused_feedback = True

    def _encode_fused(
        self, flat: torch.Tensor, params: tuple[int, int], seed: int, residual: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        scales, bits = ops.sign_encode(flat, self.block_size, residual=residual)
        return {"scales": scales, "bits": bits}
