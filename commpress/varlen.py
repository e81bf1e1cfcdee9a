"""Elias-gamma coding of QSGD levels: moved to :mod:`commpress.spec.varlen`; the old import path, re-exported."""

from __future__ import annotations

from .spec.varlen import HAVE_NUMBA, decode, encode, max_bits_per_element, max_nbytes

__all__ = ["HAVE_NUMBA", "decode", "encode", "max_bits_per_element", "max_nbytes"]
