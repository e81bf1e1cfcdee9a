"""The specification of QSGD's kernels: stochastic quantisation to s levels per bucket (Alistarh et al., 2017).

For each bucket b of ``bucket_size`` consecutive elements with norm ``n_b = ||x_b||_2``
(squares accumulated in float64 in the fixed order of :func:`~commpress.spec.numerics.tree_sum`;
float64 input is divided by the bucket's max magnitude first and the root multiplied by it;
stored as float32, or float64 for float64 input), every element is mapped to a signed level
``q_i`` in ``[-s, s]`` by stochastic rounding in 24-bit fixed point:

    p_b = 2**64 if n_b < 2**-64 else 1        (keeps r_b finite for tiny buckets; exact scaling)
    r_b = (s * (2**24 - 4)) / (n_b * p_b)     (one division per bucket; r_b = 0 when n_b == 0)
    T_i = floor((x_i * p_b) * r_b)            (a signed integer, |T_i| < s * 2**24)
    q_i = floor((T_i + v_i) / 2**24),  v_i = rng.paired_u24(seed, STREAM_QSGD, numel)[i]
    field_i = q_i + s = (T_i + v_i + s * 2**24) >> 24;   decode: x_i' = n_b * (q_i / s)

with all float arithmetic in float32 (float64 for float64 input), ``s * (2**24 - 4)`` rounded to
it, every product rounded on its own (never fused into an FMA), and ``v_i`` uniform on
[0, 2**24), two per SplitMix64 draw (:func:`commpress.rng.paired_u24`). ``x_i * p_b`` is exact,
and ``floor((T_i + v_i) / 2**24)`` is ``floor(T_i / 2**24)`` plus one with probability exactly
``(T_i mod 2**24) / 2**24``. The margin of 4 in ``r_b`` outweighs the three roundings
(``|x_i| <= n_b`` holds for the computed norm), so ``|T_i| < s * 2**24`` and ``q_i`` needs no
clamp. Per element this is one multiply, one floor, one add and one shift instead of a
division, and one hash per two elements: the encode runs near memory speed. ``q_i + s`` is
bit-packed in ``bits``-wide fields, so ``s <= 2**(bits-1) - 1``: 1 level at 2 bits, 7 at 4 bits,
127 at 8 bits.

Bias bound (the price of finite precision, as for any float kernel): ``E[q_i] = T_i / 2**24``
exactly, and ``T_i / 2**24`` is within ``2**-24 + 2**-20 * |t_i|`` of the exact
``t_i = x_i * s / n_b`` (the floor, the margin's factor ``1 - 2**-22`` and three roundings of
relative size ``<= 2**-24`` each in float32, ``2**-53`` in float64). So
``|E[C(x)_i] - x_i| <= n_b / s * 2**-24 + 2**-20 * |x_i|`` before decode's own rounding:
about ``1e-6`` of the bucket norm over s at most, far below any statistical test's resolution
(the previous specification, a division per element and a 24-bit float uniform, had a bound
of the same order). That earlier encode (``a_i = |x_i| / n_b``, ``t_i = a_i * s``, one float
uniform per draw) chose other levels for the same seed; decode, the wire layout and the
properties are unchanged, so packets of either encode decode alike and the wire version did not
change.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import rng
from ..errors import CodecError
from .bitpack import pack_bits_reference, unpack_bits_reference
from .blocks import add_block_values, corrected_input, feed_back
from .numerics import compute_dtype, scale_dtype, sqrt_rn, tree_sum

#: Field widths QSGD packs its levels in.
QSGD_BITS = (2, 4, 8)
#: fixed-point fraction bits of the stochastic rounding (the width of ``rng.paired_u24``)
FRACTION_BITS = 24


def max_levels(bits: int) -> int:
    """Largest level count s that ``bits``-wide fields can hold (sign + magnitude range)."""
    return (1 << (bits - 1)) - 1


def bucket_norms(buckets: torch.Tensor) -> torch.Tensor:
    """L2 norm of each row in float64 (squares summed by :func:`~.numerics.tree_sum`, exact sqrt).

    Squares of float32/16 values cannot overflow float64 (and are exact), so those are summed
    directly; float64 rows are divided by their largest magnitude first, which keeps
    1e300-sized input finite.
    """
    if buckets.dtype != torch.float64:
        return sqrt_rn(tree_sum(buckets.double().square()))
    amax = buckets.abs().amax(dim=1, keepdim=True) if buckets.numel() else buckets[:, :1]
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    return sqrt_rn(tree_sum((buckets / safe).square())) * amax.squeeze(1)


def encode_reference(
    x: torch.Tensor, bits: int, s: int, bucket: int, seed: int, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification of ``commpress::qsgd_encode``: ``(norms, packed levels)`` of a 1-D tensor.

    With ``residual`` (1-D, ``compute_dtype(x.dtype)``): encode ``w = (x + residual)`` rounded
    to x's dtype and overwrite ``residual`` with ``x + residual - decode(w)``. Raises
    :class:`NonFiniteError` for NaN/Inf in ``w`` and :class:`CodecError` when a norm overflows
    or exceeds x's dtype, in both cases before ``residual`` is touched.
    """
    numel = x.numel()
    ct = compute_dtype(x.dtype)
    w, corrected = corrected_input(x, residual)
    nb = -(-numel // bucket)
    padded = torch.nn.functional.pad(w.to(ct), (0, nb * bucket - numel)).view(nb, bucket)
    norms = bucket_norms(padded).to(scale_dtype(x.dtype))
    if nb and not bool(torch.isfinite(norms).all()):
        raise CodecError(f"a bucket norm overflows {scale_dtype(x.dtype)} (NaN or Inf norm)")
    if nb and float(norms.max()) > torch.finfo(x.dtype).max:
        # decoded values reach the bucket norm: it must fit the output dtype
        raise CodecError(f"a bucket norm {float(norms.max()):.4g} exceeds {x.dtype}'s range; use a smaller bucket_size")
    norm_per = norms.to(ct).unsqueeze(1)
    p = torch.where(norm_per < 2.0**-64, torch.full_like(norm_per, 2.0**64), torch.ones_like(norm_per))
    live = norm_per > 0
    safe = torch.where(live, norm_per * p, torch.ones_like(norm_per))
    top = torch.full_like(norm_per, float(s * ((1 << FRACTION_BITS) - 4)))  # rounded to ct
    r = torch.where(live, top / safe, torch.zeros_like(safe))
    fixed = torch.floor((padded * p) * r).reshape(-1)[:numel].to(torch.int64)
    v = torch.from_numpy(rng.paired_u24(seed, rng.STREAM_QSGD, numel).astype(np.int64)).to(x.device)
    fields = ((fixed + v) >> FRACTION_BITS) + s  # arithmetic shift: floor((T + v) / 2**24) + s
    packed = pack_bits_reference(fields.to(torch.uint8), bits)
    feed_back(
        x, residual, corrected, lambda out: decode_reference(norms, packed, bits, s, bucket, out, False)
    )
    return norms, packed


def decode_reference(
    norms: torch.Tensor,
    packed: torch.Tensor,
    bits: int,
    s: int,
    bucket: int,
    out: torch.Tensor,
    accumulate: bool = True,
) -> None:
    """The specification of ``commpress::qsgd_decode``: ``out (+)= norm * ((field - s) / s)``.

    Without ``accumulate`` the result is what adding to zeros gives (a -0 becomes +0).
    """

    def scaled(norm: torch.Tensor, numel: int, ct: torch.dtype) -> torch.Tensor:
        q = unpack_bits_reference(packed, bits, numel).to(ct) - s
        return norm * (q / s)

    add_block_values(out, norms, bucket, accumulate, scaled)
