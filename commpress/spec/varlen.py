"""Variable-length coding of QSGD levels: Elias-gamma codes, compiled with numba.

QSGD's levels are small and mostly zero (with s levels per bucket of d elements, a level is
about ``s * |x_i| / ||x||``, well under 1 for typical buckets), so a fixed 4- or 8-bit field
wastes most of its bits. Elias-gamma coding spends 1 bit on a zero level and a few on small
ones, as in the QSGD paper's coded variant (Alistarh et al., 2017, section 3.2).

Stream format (the specification; ``tests/test_varlen.py`` checks it against an independent
bit-string implementation). Bits are written LSB-first: bit j of the stream is bit ``j % 8``
of byte ``j // 8``; the unused high bits of the last byte are zero. For each element, with
signed level ``q`` (``|q| <= s``):

1. the Elias-gamma code of ``v = |q| + 1``: ``N = floor(log2(v))`` zero bits, then the
   ``N + 1`` bits of ``v`` from the most significant down (the first of them is the 1 that
   ends the run of zeros);
2. when ``q != 0``, one sign bit: 1 for negative.

A level of 0 costs 1 bit, +-1 and +-2 cost 4, +-3 to +-6 cost 6 (``2N + 2`` bits for
``q != 0``), at most ``2 * floor(log2(s + 1)) + 2`` bits per element: :func:`max_nbytes`. The stream has one
canonical form: :func:`decode` rejects codes longer than s allows, a stream that ends inside
an element, trailing bytes and non-zero padding, naming the element; a stream shorter than one
bit per element is rejected before anything is allocated (its output is sized by ``numel``).

The loops run under numba when it is installed (``commpress[numba]``, the dev requirements)
and as plain Python otherwise (correct, but about 100x slower).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import CodecError, WireError

try:
    from numba import njit as _njit

    def _jit(fn: Callable[..., Any]) -> Callable[..., Any]:
        return _njit(cache=True)(fn)

    HAVE_NUMBA = True
except ImportError:  # pure-Python install: the same loops, interpreted

    def _jit(fn: Callable[..., Any]) -> Callable[..., Any]:
        return fn

    HAVE_NUMBA = False

# decode status codes
_OK, _TRUNCATED, _TOO_LONG, _TRAILING, _PADDING = 0, 1, 2, 3, 4


def _floor_log2(v: int) -> int:
    return v.bit_length() - 1


def max_bits_per_element(levels: int) -> int:
    """Longest code of one element: ``2 * floor(log2(levels + 1)) + 2`` bits."""
    return 2 * _floor_log2(levels + 1) + 2


def max_nbytes(numel: int, levels: int) -> int:
    """Most bytes the gamma stream of ``numel`` levels in ``[-levels, levels]`` can take."""
    return (numel * max_bits_per_element(levels) + 7) // 8


@_jit
def _encode(fields, s, out):
    pos = 0
    for i in range(fields.size):
        q = np.int64(fields[i]) - s
        mag = q if q >= 0 else -q
        v = mag + 1
        top = 0
        while (v >> (top + 1)) > 0:
            top += 1
        pos += top  # the zero run (out is zeroed)
        for b in range(top, -1, -1):
            if (v >> b) & 1:
                out[pos >> 3] |= 1 << (pos & 7)
            pos += 1
        if q != 0:
            if q < 0:
                out[pos >> 3] |= 1 << (pos & 7)
            pos += 1
    return pos


@_jit
def _decode(stream, n, s, max_top, fields):
    total = stream.size * 8
    pos = 0
    for i in range(n):
        top = 0
        while True:
            if pos >= total:
                return _TRUNCATED, i
            bit = (stream[pos >> 3] >> (pos & 7)) & 1
            pos += 1
            if bit:
                break
            top += 1
            if top > max_top:
                return _TOO_LONG, i
        v = 1
        for _ in range(top):
            if pos >= total:
                return _TRUNCATED, i
            v = (v << 1) | ((stream[pos >> 3] >> (pos & 7)) & 1)
            pos += 1
        mag = v - 1
        if mag > s:
            return _TOO_LONG, i
        q = mag
        if mag != 0:
            if pos >= total:
                return _TRUNCATED, i
            if (stream[pos >> 3] >> (pos & 7)) & 1:
                q = -mag
            pos += 1
        fields[i] = q + s
    if (pos + 7) // 8 != stream.size:
        return _TRAILING, pos
    if pos & 7 and (stream[stream.size - 1] >> (pos & 7)) != 0:
        return _PADDING, pos
    return _OK, pos


def encode(fields: torch.Tensor, levels: int) -> torch.Tensor:
    """Gamma-code QSGD fields (``q + levels``, uint8, each <= 2 * levels); bytes on fields' device."""
    if fields.dtype != torch.uint8 or fields.dim() != 1:
        raise CodecError(f"fields must be a 1-D uint8 tensor, got {fields.dtype} {tuple(fields.shape)}")
    host = fields.detach().cpu().contiguous()
    if host.numel() and int(host.max()) > 2 * levels:
        raise CodecError(f"fields must be <= 2 * levels = {2 * levels}, got {int(host.max())}")
    out = np.zeros(max_nbytes(host.numel(), levels), dtype=np.uint8)
    nbits = _encode(host.numpy(), np.int64(levels), out)
    return torch.from_numpy(out[: (nbits + 7) // 8].copy()).to(fields.device)


def decode(stream: torch.Tensor, numel: int, levels: int) -> torch.Tensor:
    """Fields (``q + levels``, uint8) of a gamma stream of ``numel`` levels; WireError if malformed."""
    if stream.dtype != torch.uint8 or stream.dim() != 1:
        raise WireError(f"gamma stream must be a 1-D uint8 tensor, got {stream.dtype} {tuple(stream.shape)}")
    if not 0 <= numel <= 8 * stream.numel():
        # every code takes at least one bit: checked before the output is allocated
        raise WireError(
            f"section 'levels': a gamma stream of {stream.numel()} bytes cannot hold {numel} codes "
            "(each takes at least 1 bit)"
        )
    host = stream.detach().cpu().contiguous()
    fields = np.empty(numel, dtype=np.uint8)
    status, where = _decode(host.numpy(), np.int64(numel), np.int64(levels), np.int64(_floor_log2(levels + 1)), fields)
    if status == _TRUNCATED:
        raise WireError(f"section 'levels': the gamma stream ends inside element {where} of {numel}")
    if status == _TOO_LONG:
        raise WireError(f"section 'levels': element {where} codes a level above levels = {levels}")
    if status == _TRAILING:
        raise WireError(
            f"section 'levels': {host.numel()} bytes, but the {numel} codes end at bit {where} (trailing bytes)"
        )
    if status == _PADDING:
        raise WireError("section 'levels': padding bits of the last byte are not zero")
    return torch.from_numpy(fields).to(stream.device)
