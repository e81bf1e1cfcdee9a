"""Ternary storage: each block rounded stochastically to ``{-s, 0, s}``, five levels per byte.

The smallest stored kind of FSDP's compression state (``commpress.fsdp.residuals``, kind
``"ternary"``). For each block of ``block`` consecutive elements with absolute maximum ``s``
(float32, one per block), every element ``x_i`` becomes a level ``q_i`` in ``{-1, 0, 1}`` by
stochastic rounding in 24-bit fixed point, the same arithmetic as
:func:`commpress.spec.blockint.encode_stochastic_reference` with ``q_max = 1``::

    r_i = clamp(x_i / s, -1, 1)                   (s = 0: r_i = x_i = 0)
    q_i = floor((floor(r_i * 2**24) + v_i) / 2**24),  v_i = rng.paired_u24(seed, STREAM_BLOCKINT_SR, numel)[i]

so ``E[q_i * s] = x_i`` to ``2**-24 * s``: what the rounding loses is unbiased noise, never a
bias that drops small elements for good. The fields ``q_i + 1`` (0, 1, 2) are packed five per
byte in base 3, the first element the least significant digit (``sum(f_k * 3**k)``, at most 242),
the tail padded with level 0. Bytes per element: ``0.2 + 4 / block`` (0.2625 for blocks of 64,
against int4's 0.5625): what lets residuals and Adam's local velocities fit one gradient shard
at 8 ranks.

This is the specification. The native kernels ``commpress::ternary_encode_sr`` /
``ternary_decode`` (C++ CPU in ``csrc/cpu/ternary.cpp``, CUDA in ``csrc/cuda/ternary.cu``;
float32) give its bytes bit for bit, and :mod:`commpress.kernels.ternary` is the fast path with
these signatures (native where built, else this code; tests/kernels/test_ternary_kernels.py).
The uniforms are the counter-based ones every commpress kernel draws
(:func:`commpress.rng.add_paired_u24_`: numpy's hashing on the CPU,
:func:`commpress.rng.paired_u24_torch` on other devices: the same numbers), so a resumed run
stores the same codes on any device.
"""

from __future__ import annotations

import torch

from .. import rng

#: Levels per byte (3**5 = 243 <= 256).
PER_BYTE = 5
#: The largest valid byte: five fields of 2.
MAX_BYTE = 3**PER_BYTE - 1  # 242


def packed_nbytes(numel: int) -> int:
    """Bytes that hold ``numel`` levels."""
    return -(-numel // PER_BYTE)


def pack(fields: torch.Tensor) -> torch.Tensor:
    """Pack a 1-D tensor of fields in ``{0, 1, 2}`` five per byte (base 3, first field least significant)."""
    n = fields.numel()
    padded = torch.ones(packed_nbytes(n) * PER_BYTE, dtype=torch.uint8, device=fields.device)  # 1: level 0
    padded[:n] = fields
    digits = padded.view(-1, PER_BYTE)
    out = digits[:, PER_BYTE - 1].clone()
    for k in range(PER_BYTE - 2, -1, -1):  # Horner's rule in uint8: at most 242, no overflow
        out.mul_(3).add_(digits[:, k])
    return out


#: Each byte's five fields (row ``b``: the digits of ``b`` in base 3), for bytes 0-255.
_DIGITS = torch.tensor([[b // 3**k % 3 for k in range(PER_BYTE)] for b in range(256)], dtype=torch.uint8)


def unpack(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The ``numel`` fields (uint8, 0-2) of :func:`pack`'s bytes (bytes above :data:`MAX_BYTE` give wrong digits: check first)."""
    return _DIGITS.to(packed.device)[packed.long()].reshape(-1)[:numel]


def encode_stochastic(x: torch.Tensor, block: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, packed)`` of float32 ``x`` (any shape, finite): one scale per ``block`` elements, the packed levels.

    The tail is padded to a whole block with zeros (level 0), so ``packed`` holds
    ``blocks * block`` levels. ``seed`` in [0, 2**64).
    """
    flat = x.reshape(-1).to(torch.float32)
    n = flat.numel()
    nb = -(-n // block)
    rows = torch.nn.functional.pad(flat, (0, nb * block - n)).view(nb, block)
    scales = rows.abs().amax(dim=1) if nb else rows.new_zeros(0)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    # int32 holds it: |T| <= 2**24 and T + v < 2 * 2**24
    fixed = (rows / safe[:, None]).clamp_(-1.0, 1.0).reshape(-1).mul_(float(1 << 24)).floor_().to(torch.int32)
    rng.add_paired_u24_(fixed, seed, rng.STREAM_BLOCKINT_SR)
    return scales, pack(fixed.bitwise_right_shift_(24).add_(1).to(torch.uint8))


def decode(scales: torch.Tensor, packed: torch.Tensor, block: int, numel: int) -> torch.Tensor:
    """Float32 ``(q_i) * s_b`` for the first ``numel`` elements of :func:`encode_stochastic`'s output."""
    levels = unpack(packed, scales.numel() * block).to(torch.float32).sub_(1.0).view(-1, block)
    return levels.mul_(scales[:, None]).reshape(-1)[:numel]


__all__ = ["MAX_BYTE", "PER_BYTE", "decode", "encode_stochastic", "pack", "packed_nbytes", "unpack"]
