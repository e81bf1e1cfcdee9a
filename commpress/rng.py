"""Counter-based random numbers: the specification every backend reproduces bit for bit.

Stochastic codecs (random-k index choice, QSGD stochastic rounding) draw their randomness
from a stateless hash of ``(seed, stream, counter)`` instead of a stateful generator, so that
every rank, every backend (reference, C++, CUDA, numba) and every thread layout draws the same
numbers for the same seed. The hash is SplitMix64's finaliser (Steele et al., 2014) applied to
a Weyl sequence, which passes BigCrush as a counter-mode generator:

    key = mix64(seed ^ stream)
    r_i = mix64(key + (i + 1) * 0x9E3779B97F4A7C15)          (all arithmetic mod 2**64)
    mix64(z): z = (z ^ z >> 30) * 0xBF58476D1CE4E5B9
              z = (z ^ z >> 27) * 0x94D049BB133111EB
              return z ^ z >> 31

A uniform float in [0, 1) is ``(r >> 40) * 2**-24``: exactly representable in float32.
Where one draw per element is the cost (QSGD's encode), :func:`paired_u24` takes two 24-bit
uniform integers from each draw instead: ``v_{2j} = r_j mod 2**24`` and
``v_{2j+1} = (r_j >> 32) mod 2**24`` (the low 24 bits of the low and of the high 32-bit half).

Seeds themselves are derived here too, once for the whole package: :func:`derive_seed` chains
``mix64`` over ``(base, part_1, part_2, ...)`` (step, parameter, rank, phase, shard...), so
every rank computes the same seed for the same coordinates without any generator state. The
DDP collectives and the parameter server both use it.
The reference below uses numpy's wrapping uint64 arithmetic (well defined, unlike torch's
signed int64); it runs on the CPU and returns torch tensors.
"""

from __future__ import annotations

import numpy as np
import torch

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
SEED_MASK = (1 << 64) - 1
_GOLDEN_INT = 0x9E3779B97F4A7C15

# Stream ids keep the codecs' draws independent for one seed.
STREAM_RANDOMK = 0x52414E444B000001  # "RANDK"
STREAM_QSGD = 0x5153474400000002  # "QSGD"
STREAM_BLOCKINT_SR = 0x424C4B5352000003  # "BLKSR": blockint's stochastic rounding


def _mix64(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def mix64(z: int) -> int:
    """SplitMix64's finaliser on one Python int (taken mod 2**64): the scalar form of the hash."""
    z &= SEED_MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & SEED_MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & SEED_MASK
    return z ^ (z >> 31)


def derive_seed(base: int, *parts: int) -> int:
    """Hash ``base`` and non-negative integers into a 64-bit seed (SplitMix64 chaining).

    ``h = mix64(base mod 2**64)``, then ``h = mix64(h + (p + 1) * golden)`` for each part ``p``.
    A pure function of its arguments, so every rank derives the same seed for the same
    ``(base, step, parameter, ...)`` without touching any random number generator. DDP's frame
    bytes depend on it: the formula is part of the wire behaviour and must not change.
    """
    h = mix64(base)
    for p in parts:
        if p < 0:
            raise ValueError(f"derive_seed: parts must be >= 0, got {p}")
        h = mix64(h + (p + 1) * _GOLDEN_INT)
    return h


def check_seed(seed: int) -> int:
    """Return ``seed`` as an int in [0, 2**64) or raise ValueError."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= SEED_MASK:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    return seed


def key(seed: int, stream: int) -> np.uint64:
    """Return ``mix64(seed ^ stream)``, the key of one (seed, stream) sequence."""
    with np.errstate(over="ignore"):
        return _mix64(np.array([check_seed(seed) ^ stream], dtype=np.uint64))[0]


def random_u64(seed: int, stream: int, start: int, count: int) -> np.ndarray:
    """Return the ``count`` 64-bit draws ``r_start .. r_{start+count-1}`` as a uint64 array."""
    with np.errstate(over="ignore"):
        key_ = key(seed, stream)
        counters = np.arange(start + 1, start + count + 1, dtype=np.uint64)
        return _mix64(key_ + counters * GOLDEN)


def uniform_f32(seed: int, stream: int, count: int) -> torch.Tensor:
    """Return ``count`` float32 uniforms in [0, 1): ``(r_i >> 40) * 2**-24`` for i < count."""
    r = random_u64(seed, stream, 0, count) >> np.uint64(40)
    return torch.from_numpy((r.astype(np.float32) * np.float32(2.0**-24)).astype(np.float32))


def paired_u24(seed: int, stream: int, count: int) -> np.ndarray:
    """Return ``count`` 24-bit uniform integers, two per 64-bit draw, as a uint32 array.

    ``v_i = (r_{i // 2} >> (32 * (i % 2))) mod 2**24``: element 2j takes the low 24 bits of the
    low half of ``r_j``, element 2j + 1 those of the high half (disjoint bits of one SplitMix64
    output, whose every bit is usable). Each ``v_i`` is uniform on [0, 2**24); the pair shares
    one hash, which halves the hashing cost of a per-element draw. Seen as 32-bit lanes in
    little-endian order the draws ``r_j`` are the halves ``h_i``, and ``v_i = h_i & 0xFFFFFF``:
    one logic op per lane in SIMD and GPU kernels.
    """
    r = random_u64(seed, stream, 0, (count + 1) // 2)
    halves = np.empty(2 * r.size, dtype=np.uint32)
    halves[0::2] = (r & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    halves[1::2] = (r >> np.uint64(32)).astype(np.uint32)
    return halves[:count] & np.uint32(0xFFFFFF)


def below(seed: int, stream: int, bounds: torch.Tensor) -> torch.Tensor:
    """Return one integer in ``[0, bounds[j])`` per j: ``(r_j >> 32) * bounds[j] >> 32``.

    Lemire's multiply-shift on the high 32 bits; ``bounds`` must be in [1, 2**32). The bias is
    below 2**-32 relative, far under any statistical test's resolution.
    """
    b = bounds.cpu().numpy().astype(np.uint64)
    hi = random_u64(seed, stream, 0, b.size) >> np.uint64(32)
    return torch.from_numpy(((hi * b) >> np.uint64(32)).astype(np.int64))


def _signed(c: int) -> int:
    """``c`` in [0, 2**64) as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 lanes seen as uint64 (torch's ``>>`` is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def paired_u24_torch(seed: int, stream: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """:func:`paired_u24` computed on ``device`` with torch's int64 arithmetic, as an int64 tensor.

    The same numbers bit for bit (tests/test_rng.py): int64 products wrap modulo 2**64 like
    uint64 ones, and the shifts are masked to be logical. For fallback paths on devices where
    a numpy round trip would cost more than the hashing (a CUDA tensor without the native op).
    """
    half = (count + 1) // 2
    j = torch.arange(1, half + 1, dtype=torch.int64, device=device)
    z = j * _signed(_GOLDEN_INT) + _signed(int(key(seed, stream)))
    z = (z ^ _shr(z, 30)) * _signed(int(_M1))
    z = (z ^ _shr(z, 27)) * _signed(int(_M2))
    z = z ^ _shr(z, 31)
    mask = 0xFFFFFF
    return torch.stack((z & mask, _shr(z, 32) & mask), 1).reshape(-1)[:count]


def add_paired_u24_(fixed: torch.Tensor, seed: int, stream: int) -> torch.Tensor:
    """``fixed += paired_u24(seed, stream, fixed.numel())`` in place, on ``fixed``'s device; returns ``fixed``.

    ``fixed`` is a contiguous 1-D int32 tensor (the 24-bit fixed point of a stochastic
    rounding, whose sums with the uniforms int32 holds). On the CPU the uniforms come from
    numpy's uint64 hashing (:func:`paired_u24`, about twice torch's int64 there), elsewhere from
    :func:`paired_u24_torch` on the device: the same numbers either way.
    """
    n = fixed.numel()
    if fixed.device.type == "cpu":
        fixed += torch.from_numpy(paired_u24(seed, stream, n).view("int32"))
    else:
        fixed += paired_u24_torch(seed, stream, n, fixed.device).to(torch.int32)
    return fixed
