"""The in-memory form of one compressed tensor, shared by codecs, the wire format and collectives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

# Dtypes a codec accepts as input, with their one-byte wire codes.
FLOAT_DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
}


class Section(NamedTuple):
    """One typed array of a packet: its name, element dtype and element count.

    A ``variable`` section (variable-length coding) holds at most ``numel`` elements; its actual
    length travels in the packet's section table.
    """

    name: str
    dtype: torch.dtype
    numel: int
    variable: bool = False

    @property
    def nbytes(self) -> int:
        """Size of the section's payload in bytes (without wire padding)."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True, eq=False)
class Packet:
    """A tensor encoded by a codec: everything needed to decode it, nothing else.

    ``params`` are the two codec parameters carried on the wire (their meaning is the codec's:
    e.g. ``(k, 0)`` for top-k); ``sections`` holds the codec's arrays in wire order.
    """

    codec: str
    dtype: torch.dtype
    numel: int
    params: tuple[int, int]
    seed: int
    sections: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        """Device of the sections (CPU for a packet with no payload)."""
        for t in self.sections.values():
            return t.device
        return torch.device("cpu")

    def payload_nbytes(self) -> int:
        """Bytes of all sections, without the wire header and padding."""
        return sum(t.numel() * t.element_size() for t in self.sections.values())
