"""``none``: the identity codec; the dense baseline inside the same framework."""

from __future__ import annotations

from typing import Any

import torch

from ..wire.packet import Packet, Section
from .base import Codec, check_finite_section, require_finite


class NoneCodec(Codec):
    """Send the tensor as it is. Exact: unbiased, contraction delta = 1."""

    name = "none"
    codec_id = 1
    unbiased = True
    summable = True
    lossless = True

    def config(self) -> dict[str, Any]:
        """Return ``{"name": "none"}``."""
        return {"name": self.name}

    def delta(self, numel: int) -> float:
        """Exact codec: ``||C(x) - x|| = 0``."""
        return 1.0

    @classmethod
    def layout(cls, numel: int, dtype: torch.dtype, params: tuple[int, int]) -> list[Section]:
        """One section ``values`` of ``numel`` elements of the input dtype."""
        return [Section("values", dtype, numel)]

    @classmethod
    def check_content(cls, packet: Packet) -> None:
        """Reject non-finite values: the encoder never produces them."""
        check_finite_section(packet, "values")

    def _encode(self, flat: torch.Tensor, params: tuple[int, int], seed: int) -> dict[str, torch.Tensor]:
        require_finite(flat)
        return {"values": flat.clone()}

    def _decode_add(self, packet: Packet, out: torch.Tensor) -> None:
        out.add_(packet.sections["values"])
