"""``sign``: 1 bit per element plus one scale per block (EF-signSGD, Karimireddy et al. 2019).

Encoding: bit i is 1 when ``x_i < 0`` and 0 otherwise (so 0 and -0.0 both decode to +scale);
the block's scale is its mean magnitude ``||x_b||_1 / L_b`` (accumulated in float64, stored as
float32, or float64 for float64 input). ``block_size=0`` means one block for the whole tensor.

Properties: deterministic, biased, contractive: the mean magnitude is the scale that minimises
the error, leaving ``||C(x) - x||^2 = ||x||^2 - ||x||_1^2 / L <= (1 - 1/L) ||x||^2`` per block,
so ``delta = 1 / L`` with L the largest block length.

Wire: ``scales`` (one per block) then ``bits`` (ceil(d/8) bytes, LSB-first, zero padding);
``param0 = block_size``. About 1 bit per element: a 32x reduction for float32.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import ops
from ..bitpack import packed_nbytes, padding_is_zero
from ..errors import CodecError, WireError
from ..packet import Packet, Section
from .base import Codec, check_scales, compute_dtype, scale_dtype


def n_blocks(numel: int, block_size: int) -> int:
    """Number of scale blocks for ``numel`` elements (``block_size=0``: one block)."""
    if numel == 0:
        return 0
    return 1 if block_size == 0 else -(-numel // block_size)


class SignCodec(Codec):
    """Scaled 1-bit sign compression; ``block_size`` elements share one scale (0 = whole tensor)."""

    name = "sign"
    codec_id = 6

    def __init__(self, block_size: int = 0) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 0:
            raise CodecError(f"sign: block_size must be an int >= 0, got {block_size!r}")
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
        """``param1`` must be 0; any block size is valid."""
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
        numel = flat.numel()
        size = params[0] or numel
        nb = n_blocks(numel, params[0])
        # float64 accumulation: the sum of |x| neither overflows nor loses small blocks.
        mags = torch.nn.functional.pad(flat.abs().double(), (0, nb * size - numel))
        sums = mags.view(nb, size).sum(dim=1)
        lengths = torch.full((nb,), float(size), dtype=torch.float64, device=flat.device)
        if nb:
            lengths[-1] = numel - size * (nb - 1)
        scales = (sums / lengths).to(scale_dtype(flat.dtype))
        if nb and not bool(torch.isfinite(scales).all()):
            raise CodecError(
                "x contains NaN or Inf (or a block's mean magnitude overflows); "
                "commpress does not encode non-finite values"
            )
        bits = ops.pack_bits((flat < 0).to(torch.uint8), 1)
        return {"scales": scales, "bits": bits}

    def _decode_add(self, packet: Packet, out: torch.Tensor) -> None:
        numel = packet.numel
        negative = ops.unpack_bits(packet.sections["bits"], 1, numel).bool()
        ct = compute_dtype(packet.dtype)
        scales = packet.sections["scales"].to(ct)
        size = packet.params[0] or numel
        per_element = scales.repeat_interleave(size)[:numel]
        out.add_(torch.where(negative, -per_element, per_element).to(out.dtype))
