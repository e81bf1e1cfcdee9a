"""Bit-field packing: moved to :mod:`commpress.spec.bitpack`; the old import path, re-exported."""

from __future__ import annotations

from .spec.bitpack import (
    SUPPORTED_BITS,
    check_bits,
    pack_bits_reference,
    packed_nbytes,
    padding_is_zero,
    unpack_bits_reference,
)

__all__ = ["SUPPORTED_BITS", "check_bits", "pack_bits_reference", "packed_nbytes", "padding_is_zero", "unpack_bits_reference"]
