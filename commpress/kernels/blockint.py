"""Fast paths of the ``int8`` / ``int4`` codecs, bit for bit :mod:`commpress.spec.blockint`.

:func:`encode`, :func:`encode_stochastic` (stochastic rounding, ``blockint_encode_sr``) and :func:`decode` run the dispatcher ops ``commpress::blockint_encode`` /
``blockint_decode`` where the native extension has them for the tensor's device (the C++ CPU
kernels of ``csrc/cpu/blockint.cpp``: one pass over the input, AVX-512 for float32; the CUDA
kernels of ``csrc/cuda/blockint.cu`` in a CUDA build), and otherwise (no extension,
``COMMPRESS_DISABLE_NATIVE``, CUDA tensors with a CPU-only build, another backend chosen by
:func:`commpress.kernels.ops.use_backend`) the vectorised torch path below: the same IEEE
operations as the specification in the same dtype (so the same bits), without its copies: no
padding copy when the length is a multiple of the block (the tail block is handled on its
own), the division, rounding and clamp in place, the scale broadcast over a ``(blocks,
block)`` view instead of repeated per element, and bit packing through
:func:`commpress.kernels.ops.pack_bits`. tests/codecs/test_blockint.py checks both against the
reference; tests/kernels/test_blockint_kernels.py checks the native CPU and CUDA kernels.
"""

from __future__ import annotations

import torch

from .. import rng
from ..errors import CodecError
from ..spec.blockint import QMAX, check_decodable, n_blocks
from ..spec.numerics import compute_dtype, require_finite, scale_dtype
from . import ops


def _rows(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(full, tail)``: the whole blocks as a ``(nb, block)`` view, and the short last block (or None)."""
    whole = x.numel() // block * block
    full = x[:whole].view(-1, block)
    return full, (x[whole:] if whole < x.numel() else None)


def _native(op: str, device_type: str) -> bool:
    return ops.backend_for(op, device_type) == "native"


def encode(x: torch.Tensor, bits: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, packed)`` of a contiguous 1-D tensor, identical to ``encode_reference``."""
    if _native("blockint_encode", x.device.type):
        return ops.blockint_encode(x, bits, block_size)
    return encode_torch(x, bits, block_size)


def _scaled(x: torch.Tensor, bits: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, x / safe)`` in the compute dtype: what both rounding modes start from (checks included)."""
    require_finite(x)
    qmax = QMAX[bits]
    ct = compute_dtype(x.dtype)
    numel = x.numel()
    xc = x if x.dtype == ct else x.to(ct)
    full, tail = _rows(xc, block_size)
    scales = torch.empty(n_blocks(numel, block_size), dtype=ct, device=x.device)
    nfull = full.shape[0]
    if nfull:
        torch.amax(full.abs(), dim=1, out=scales[:nfull])
    if tail is not None:
        scales[nfull] = tail.abs().amax()
    scales.div_(qmax)
    if not check_decodable(scales, bits, x.dtype):
        raise CodecError(f"values too close to {x.dtype}'s largest value: the decode of int{bits} would overflow")
    safe = torch.where(scales > 0, scales, 1.0)
    q = torch.empty(numel, dtype=ct, device=x.device)
    qf, qt = _rows(q, block_size)
    if nfull:
        torch.div(full, safe[:nfull, None], out=qf)
    if tail is not None and qt is not None:
        torch.div(tail, safe[nfull], out=qt)
    return scales, q


def _packed(scales: torch.Tensor, fields: torch.Tensor, bits: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return scales.to(scale_dtype(dtype)), (fields if bits == 8 else ops.pack_bits(fields, bits))


def encode_torch(x: torch.Tensor, bits: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`encode` in vectorised torch (any device), the fallback of the native op."""
    qmax = QMAX[bits]
    scales, q = _scaled(x, bits, block_size)
    q.round_().clamp_(-qmax, qmax).add_(qmax)
    return _packed(scales, q.to(torch.uint8), bits, x.dtype)


def encode_stochastic(x: torch.Tensor, bits: int, block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`encode` with stochastic rounding, identical to ``encode_stochastic_reference`` (seed in [0, 2**64))."""
    if _native("blockint_encode_sr", x.device.type):
        return ops.blockint_encode_sr(x, bits, block_size, seed)
    return encode_stochastic_torch(x, bits, block_size, seed)


def encode_stochastic_torch(x: torch.Tensor, bits: int, block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`encode_stochastic` in vectorised torch (the uniforms added on ``x``'s device by :func:`commpress.rng.add_paired_u24_`).

    About 20x slower than the native CPU kernel (the hashing is most of it); what a
    CPU install without the extension, or a CUDA tensor with a CPU-only build, runs.
    """
    qmax = QMAX[bits]
    scales, r = _scaled(x, bits, block_size)
    # int32 holds it all: |T| <= q_max * 2**24 and T + v < (q_max + 1) * 2**24 <= 2**31
    fixed = r.clamp_(-qmax, qmax).mul_(float(1 << 24)).floor_().to(torch.int32)
    rng.add_paired_u24_(fixed, seed, rng.STREAM_BLOCKINT_SR)
    return _packed(scales, fixed.bitwise_right_shift_(24).add_(qmax).to(torch.uint8), bits, x.dtype)


def decode(scales: torch.Tensor, packed: torch.Tensor, bits: int, block_size: int, out: torch.Tensor,
           accumulate: bool = False) -> None:
    """``out (+)= q_i * s_b`` into a contiguous 1-D ``out``, identical to ``decode_reference``."""
    if _native("blockint_decode", out.device.type):
        ops.blockint_decode(scales, packed, bits, block_size, out, accumulate)
        return
    decode_torch(scales, packed, bits, block_size, out, accumulate)


def decode_torch(scales: torch.Tensor, packed: torch.Tensor, bits: int, block_size: int, out: torch.Tensor,
                 accumulate: bool = False) -> None:
    """:func:`decode` in vectorised torch (any device); a fresh decode may leave a -0 the reference makes +0."""
    numel = out.numel()
    if numel == 0:
        return
    qmax = QMAX[bits]
    ct = compute_dtype(out.dtype)
    fields = packed if bits == 8 else ops.unpack_bits(packed, bits, numel)
    vals = fields.to(ct).sub_(qmax)
    full, tail = _rows(vals, block_size)
    nfull = full.shape[0]
    s = scales.to(ct)
    if nfull:
        full.mul_(s[:nfull, None])
    if tail is not None:
        tail.mul_(s[nfull])
    if accumulate:
        out.add_(vals if out.dtype == ct else vals.to(out.dtype))
    else:
        out.copy_(vals)  # the reference adds to zeros: differs only in a -0 (a hostile scale 0 with q < 0)
