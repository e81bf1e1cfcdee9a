"""``fp16`` and ``bf16``: cast to a 16-bit float on the wire (2 bytes per element).

Deterministic; biased only by rounding (relative error <= 2**-11 for fp16, 2**-8 for bf16, for
values in the normal range: values below it lose precision, so no contraction bound is stated).
fp16 overflows above 65504: such input raises :class:`CodecError` instead of sending Inf
(use ``bf16``, which has float32's range). Likewise float16 input that ``bf16`` rounds beyond
65504 (65408 and above, to 65536), and on the receiving side a packet whose values do not fit its
dtype, so a validated packet always decodes to finite values.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..errors import CodecError
from ..wire.packet import Packet, Section
from .base import Codec, all_finite, check_values_fit, require_finite


class _CastCodec(Codec):
    """What fp16 and bf16 share: one section of the 16-bit dtype, values that sum on the wire."""

    wire_dtype: ClassVar[torch.dtype]
    overflow_hint: ClassVar[str]
    summable = True
    lossless = True  # rounding only

    def config(self) -> dict[str, Any]:
        """Return ``{"name": <fp16|bf16>}``."""
        return {"name": self.name}

    @classmethod
    def layout(cls, numel: int, dtype: torch.dtype, params: tuple[int, int]) -> list[Section]:
        """One section ``values`` of ``numel`` elements of the 16-bit wire dtype."""
        return [Section("values", cls.wire_dtype, numel)]

    def _encode(self, flat: torch.Tensor, params: tuple[int, int], seed: int) -> dict[str, torch.Tensor]:
        require_finite(flat)
        values = flat.to(self.wire_dtype, copy=True)
        if not all_finite(values):
            raise CodecError(
                f"x has values beyond {self.name}'s range (max {torch.finfo(self.wire_dtype).max}); "
                f"{self.overflow_hint}"
            )
        limit = torch.finfo(flat.dtype).max
        if values.numel() and limit < torch.finfo(self.wire_dtype).max and float(values.abs().max()) > limit:
            # float16 input of 65408 or more rounds to 65536 in bf16, which float16 cannot hold
            raise CodecError(
                f"x has values that round beyond {flat.dtype}'s range in {self.name} "
                f"(max {limit}); use the fp16 codec for float16 tensors this large"
            )
        return {"values": values}

    @classmethod
    def check_content(cls, packet: Packet) -> None:
        """Values finite and within the packet dtype's range (the decode stays finite)."""
        check_values_fit(packet, "values")

    def _decode_add(self, packet: Packet, out: torch.Tensor) -> None:
        out.add_(packet.sections["values"].to(out.dtype))


class Fp16Codec(_CastCodec):
    """Cast to IEEE half precision."""

    name = "fp16"
    codec_id = 2
    wire_dtype = cast_dtype = torch.float16
    overflow_hint = "use the bf16 codec, which has float32's range"


class Bf16Codec(_CastCodec):
    """Cast to bfloat16 (float32's exponent range, 8-bit mantissa)."""

    name = "bf16"
    codec_id = 3
    wire_dtype = cast_dtype = torch.bfloat16
    overflow_hint = "use the none codec for float64 values this large"
