"""Reference bit-field packing: the specification the native kernels are tested against.

A stream of ``n`` small unsigned fields, each ``bits`` wide (``bits`` in {1, 2, 4, 8}), is
packed LSB-first into ``ceil(n * bits / 8)`` bytes: field ``i`` lives in byte
``(i * bits) // 8`` at bit offset ``(i * bits) % 8``. Unused high bits of the last byte are
zero; :func:`unpack_bits` reports whether they were (the wire decoder rejects packets whose
padding is not zero, so every packet has one canonical byte form).
"""

from __future__ import annotations

import torch

from ..errors import CodecError

SUPPORTED_BITS = (1, 2, 4, 8)


def packed_nbytes(n: int, bits: int) -> int:
    """Return the number of bytes that ``n`` fields of ``bits`` bits occupy once packed."""
    check_bits(bits)
    if n < 0:
        raise CodecError(f"n must be >= 0, got {n}")
    return (n * bits + 7) // 8


def check_bits(bits: int) -> None:
    """Raise :class:`CodecError` unless ``bits`` is a supported field width."""
    if bits not in SUPPORTED_BITS:
        raise CodecError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")


def pack_bits_reference(fields: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a 1-D uint8 tensor of fields (each < 2**bits) into bytes, LSB-first."""
    check_bits(bits)
    if fields.dtype != torch.uint8 or fields.dim() != 1:
        raise CodecError(f"fields must be a 1-D uint8 tensor, got {fields.dtype} {tuple(fields.shape)}")
    n = fields.numel()
    if n and bits < 8 and int(fields.max()) >= (1 << bits):
        raise CodecError(f"fields must be < 2**bits = {1 << bits}, got max {int(fields.max())}")
    if bits == 8:
        return fields.clone()
    per_byte = 8 // bits
    padded = torch.zeros(packed_nbytes(n, bits) * per_byte, dtype=torch.int32, device=fields.device)
    padded[:n] = fields.to(torch.int32)
    shifts = torch.arange(per_byte, dtype=torch.int32, device=fields.device) * bits
    return (padded.view(-1, per_byte) << shifts).sum(dim=1).to(torch.uint8)


def unpack_bits_reference(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Unpack ``n`` fields of ``bits`` bits from a 1-D uint8 tensor made by pack_bits."""
    check_bits(bits)
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise CodecError(f"packed must be a 1-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    expected = packed_nbytes(n, bits)
    if packed.numel() != expected:
        raise CodecError(f"packed holds {packed.numel()} bytes, {n} fields of {bits} bits need {expected}")
    if bits == 8:
        return packed.clone()
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, dtype=torch.int32, device=packed.device) * bits
    mask = (1 << bits) - 1
    fields = (packed.to(torch.int32).unsqueeze(1) >> shifts) & mask
    return fields.reshape(-1)[:n].to(torch.uint8)


def padding_is_zero(packed: torch.Tensor, bits: int, n: int) -> bool:
    """Return True when the unused high bits of the last packed byte are all zero."""
    used = (n * bits) % 8
    if used == 0 or packed.numel() == 0:
        return True
    return int(packed[-1]) >> used == 0
