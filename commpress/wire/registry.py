"""The codec-id registry: which codec a wire id (and a name) stands for.

The wire owns it; codec classes register into it when :mod:`commpress.codecs` is imported. The
wire needs only what a header and a layout say, stated here as :class:`WireCodec`, so nothing
in :mod:`commpress.wire` imports a codec.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch

from ..errors import CodecError
from .packet import Packet, Section

__all__ = ["WireCodec", "by_id", "by_name", "names", "register"]


class WireCodec(Protocol):
    """What the wire asks of a codec: its name and id, header parameters, layout and content checks."""

    name: ClassVar[str]
    codec_id: ClassVar[int]

    @property
    def fixed_size(self) -> bool:
        """True when every packet for one numel and dtype has the same size."""
        ...

    def wire_params(self, numel: int) -> tuple[int, int]:
        """The two header parameters for a tensor of ``numel`` elements."""
        ...

    def wire_size(self, numel: int, dtype: torch.dtype = ...) -> int:
        """Bytes of a packet for ``numel`` elements of ``dtype`` (the most, when not fixed)."""
        ...

    @classmethod
    def check_wire_params(cls, numel: int, params: tuple[int, int]) -> None:
        """Raise :class:`~commpress.errors.WireError` when header parameters are invalid."""
        ...

    @classmethod
    def layout(cls, numel: int, dtype: torch.dtype, params: tuple[int, int]) -> list[Section]:
        """Sections of a packet, a pure function of the header."""
        ...

    @classmethod
    def check_content(cls, packet: Packet) -> None:
        """Raise :class:`~commpress.errors.WireError` when decoded sections break the codec's rules."""
        ...


_BY_NAME: dict[str, type[WireCodec]] = {}
_BY_ID: dict[int, type[WireCodec]] = {}


def register(cls: type[WireCodec]) -> None:
    """Add a codec class; its name and wire id (1..255) must be new (:class:`CodecError` otherwise)."""
    if cls.name in _BY_NAME or cls.codec_id in _BY_ID or not 0 < cls.codec_id < 256:
        raise CodecError(f"codec {cls.name!r} (wire id {cls.codec_id}) clashes with a registered one or is out of range")
    _BY_NAME[cls.name] = cls
    _BY_ID[cls.codec_id] = cls


def names() -> list[str]:
    """Registered codec names, in registration order."""
    return list(_BY_NAME)


def by_name(name: str) -> type[WireCodec]:
    """The codec class registered under ``name``; :class:`CodecError` if unknown."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise CodecError(f"unknown codec {name!r}; available: {', '.join(_BY_NAME)}") from None


def by_id(codec_id: int) -> type[WireCodec] | None:
    """The codec class with wire id ``codec_id``, or None."""
    return _BY_ID.get(codec_id)
