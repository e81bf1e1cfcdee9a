"""Typed wrappers over the native ``torch.ops.commpress`` kernels, with reference fallbacks.

The extension ``commpress._C`` is optional: it is loaded lazily and defensively, so
``import commpress`` never fails because it is missing (pure-Python install, or a build for
another torch) and never initialises CUDA. Every wrapper picks the native kernel when one is
registered for the tensor's device and falls back to the pure-torch reference otherwise;
both produce bit-identical results (tests/test_native.py checks it).

Set ``COMMPRESS_DISABLE_NATIVE=1`` to force the reference path (used by the tests to check
that the package works without the extension).
"""

from __future__ import annotations

import importlib
import os
from functools import lru_cache

import torch

from .bitpack import check_bits, pack_bits_reference, packed_nbytes, unpack_bits_reference
from .errors import CodecError

_OPS = ("pack_bits", "unpack_bits")


@lru_cache(maxsize=1)
def load_native() -> str | None:
    """Load the extension once; return None on success or the reason it is unavailable."""
    if os.environ.get("COMMPRESS_DISABLE_NATIVE", "") not in ("", "0"):
        return "disabled by COMMPRESS_DISABLE_NATIVE"
    try:
        importlib.import_module("commpress._C")  # loading the library registers the ops
    except (ImportError, OSError) as exc:  # missing build, ABI mismatch, missing libs
        return f"{type(exc).__name__}: {exc}"
    _register_fakes()
    return None


def has_native(op: str, device_type: str = "cpu") -> bool:
    """Return True when ``commpress::op`` has a native kernel for ``device_type`` (cpu/cuda)."""
    if load_native() is not None:
        return False
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    if key is None:
        return False
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"commpress::{op}", key))


def native_ops() -> dict[str, list[str]]:
    """Map each native op name to the device types it has kernels for (empty when unbuilt)."""
    return {op: [d for d in ("cpu", "cuda") if has_native(op, d)] for op in _OPS}


def _register_fakes() -> None:
    # Shape functions so torch.compile / opcheck can trace the ops without running them.
    @torch.library.register_fake("commpress::pack_bits")
    def _pack_fake(fields: torch.Tensor, bits: int) -> torch.Tensor:
        return fields.new_empty(packed_nbytes(fields.numel(), bits), dtype=torch.uint8)

    @torch.library.register_fake("commpress::unpack_bits")
    def _unpack_fake(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
        return packed.new_empty(n, dtype=torch.uint8)


def pack_bits(fields: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a 1-D uint8 tensor of ``bits``-wide fields LSB-first (see :mod:`commpress.bitpack`)."""
    check_bits(bits)
    if fields.dtype != torch.uint8 or fields.dim() != 1:
        raise CodecError(f"fields must be a 1-D uint8 tensor, got {fields.dtype} {tuple(fields.shape)}")
    if has_native("pack_bits", fields.device.type):
        try:
            return torch.ops.commpress.pack_bits.default(fields.contiguous(), bits)
        except RuntimeError as exc:  # TORCH_CHECK failures: re-raise as our error type
            raise CodecError(str(exc).splitlines()[0]) from exc
    return pack_bits_reference(fields, bits)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Unpack ``n`` fields of ``bits`` bits from bytes made by :func:`pack_bits`."""
    check_bits(bits)
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise CodecError(f"packed must be a 1-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    if packed.numel() != packed_nbytes(n, bits):
        raise CodecError(
            f"packed holds {packed.numel()} bytes, {n} fields of {bits} bits need {packed_nbytes(n, bits)}"
        )
    if has_native("unpack_bits", packed.device.type):
        try:
            return torch.ops.commpress.unpack_bits.default(packed.contiguous(), bits, n)
        except RuntimeError as exc:
            raise CodecError(str(exc).splitlines()[0]) from exc
    return unpack_bits_reference(packed, bits, n)
