"""``qsgd``: stochastic quantisation to s levels per bucket (Alistarh et al., 2017).

For each bucket b of ``bucket_size`` consecutive elements with norm ``n_b = ||x_b||_2``
(squares accumulated in float64 in the fixed order of :func:`commpress.codecs.base.tree_sum`;
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

Kernels: :func:`encode_reference` / :func:`decode_reference` below are the specification;
``commpress.kernels.ops.qsgd_encode`` / ``qsgd_decode`` run the native CPU/CUDA kernels when built,
bit-identical to them (same seed, same bytes on every backend).
:meth:`QSGDCodec.encode_with_feedback` fuses error feedback into the encode.

Properties: unbiased, ``E[C(x)] = x``; variance per bucket of d elements
``E||C(x) - x||^2 <= min(d / s^2, sqrt(d) / s) * ||x||^2`` (QSGD, Lemma 3.1).

Wire: ``norms`` (one per bucket) then ``levels``; ``param0 = bits | s << 8 | coding << 16``,
``param1 = bucket_size``. With ``coding="fixed"`` (0, the default) ``levels`` holds the packed
``bits``-wide fields. With ``coding="gamma"`` (1) it holds the Elias-gamma stream of the same
levels (:mod:`commpress.varlen`): the decoded tensor is identical, the packet smaller (about 1.5
to 2 bits per element instead of 4 at ``bits=4`` on real gradients) and variable in size, so
it suits the parameter server (one message per worker) but not DDP's fixed-size collectives.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import rng, varlen
from ..bitpack import pack_bits_reference, packed_nbytes, padding_is_zero, unpack_bits_reference
from ..errors import CodecError, WireError
from ..kernels import ops
from ..wire.packet import Packet, Section
from ._blocks import add_block_values, corrected_input, feed_back
from .base import (
    Codec,
    check_scales,
    compute_dtype,
    scale_dtype,
    sqrt_rn,
    tree_sum,
)

QSGD_BITS = (2, 4, 8)
#: fixed-point fraction bits of the stochastic rounding (the width of ``rng.paired_u24``)
FRACTION_BITS = 24
#: ``coding`` option -> its code in ``param0 >> 16``
CODINGS = {"fixed": 0, "gamma": 1}


def max_levels(bits: int) -> int:
    """Largest level count s that ``bits``-wide fields can hold (sign + magnitude range)."""
    return (1 << (bits - 1)) - 1


def bucket_norms(buckets: torch.Tensor) -> torch.Tensor:
    """L2 norm of each row in float64 (squares summed by :func:`~.base.tree_sum`, exact sqrt).

    Squares of float32/16 values cannot overflow float64 (and are exact), so those are summed
    directly; float64 rows are divided by their largest magnitude first, which keeps
    1e300-sized input finite.
    """
    if buckets.dtype != torch.float64:
        return sqrt_rn(tree_sum(buckets.double().square()))
    amax = buckets.abs().amax(dim=1, keepdim=True) if buckets.numel() else buckets[:, :1]
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    return sqrt_rn(tree_sum((buckets / safe).square())) * amax.squeeze(1)


class QSGDCodec(Codec):
    """QSGD with ``bits`` in {2, 4, 8}; ``levels`` defaults to the most the width allows."""

    name = "qsgd"
    codec_id = 7
    reencodable = True
    unbiased = True
    stochastic = True

    def __init__(
        self, bits: int = 4, levels: int | None = None, bucket_size: int = 512, coding: str = "fixed"
    ) -> None:
        if coding not in CODINGS:
            raise CodecError(f"qsgd: coding must be one of {', '.join(CODINGS)}, got {coding!r}")
        if bits not in QSGD_BITS:
            raise CodecError(f"qsgd: bits must be one of {QSGD_BITS}, got {bits!r}")
        top = max_levels(bits)
        if levels is None:
            levels = top
        if not isinstance(levels, int) or isinstance(levels, bool) or not 1 <= levels <= top:
            raise CodecError(f"qsgd: levels must be an int in [1, {top}] for bits={bits}, got {levels!r}")
        if not isinstance(bucket_size, int) or isinstance(bucket_size, bool) or not 1 <= bucket_size < 1 << 32:
            raise CodecError(f"qsgd: bucket_size must be an int in [1, 2**32), got {bucket_size!r}")
        self.bits = bits
        self.levels = levels
        self.bucket_size = bucket_size
        self.coding = coding

    @property
    def fixed_size(self) -> bool:
        """False with ``coding="gamma"``: the packet size depends on the data."""
        return self.coding == "fixed"

    def block_alignment(self) -> int:
        """One norm per ``bucket_size`` elements: pieces are cut on bucket boundaries."""
        return self.bucket_size

    def config(self) -> dict[str, Any]:
        """Return ``{"name": "qsgd", "bits", "levels", "bucket_size"}``, plus ``coding`` unless fixed."""
        cfg: dict[str, Any] = {"name": self.name, "bits": self.bits, "levels": self.levels, "bucket_size": self.bucket_size}
        if self.coding != "fixed":
            cfg["coding"] = self.coding
        return cfg

    def variance_bound(self, numel: int) -> float:
        """``min(d/s^2, sqrt(d)/s)`` with d the bucket length: E||C(x)-x||^2 <= this * ||x||^2."""
        d = min(numel, self.bucket_size)
        s = self.levels
        return min(d / s**2, d**0.5 / s)

    def wire_params(self, numel: int) -> tuple[int, int]:
        """``(bits | levels << 8 | coding << 16, bucket_size)``."""
        return (self.bits | self.levels << 8 | CODINGS[self.coding] << 16, self.bucket_size)

    @staticmethod
    def unpack_params(params: tuple[int, int]) -> tuple[int, int, int]:
        """Return ``(bits, levels, bucket_size)`` from header parameters."""
        return params[0] & 0xFF, (params[0] >> 8) & 0xFF, params[1]

    @staticmethod
    def is_gamma(params: tuple[int, int]) -> bool:
        """True when the header parameters say ``coding="gamma"``."""
        return params[0] >> 16 == CODINGS["gamma"]

    @classmethod
    def check_wire_params(cls, numel: int, params: tuple[int, int]) -> None:
        """Bits in {2, 4, 8}, levels in [1, 2**(bits-1) - 1], bucket size in [1, 2**32), known coding."""
        if params[0] >> 16 not in CODINGS.values():
            raise WireError(f"params.coding: must be one of {sorted(CODINGS.values())}, got {params[0] >> 16}")
        bits, levels, bucket = cls.unpack_params(params)
        if bits not in QSGD_BITS:
            raise WireError(f"params.bits: must be one of {QSGD_BITS}, got {bits}")
        if not 1 <= levels <= max_levels(bits):
            raise WireError(f"params.levels: must be in [1, {max_levels(bits)}] for bits={bits}, got {levels}")
        if not 1 <= bucket < 1 << 32:
            raise WireError(f"params.bucket_size: must be in [1, 2**32), got {bucket}")

    @classmethod
    def layout(cls, numel: int, dtype: torch.dtype, params: tuple[int, int]) -> list[Section]:
        """``norms`` (one per bucket) and ``levels`` (numel packed fields, or their gamma stream)."""
        bits, s, bucket = cls.unpack_params(params)
        norms = Section("norms", scale_dtype(dtype), -(-numel // bucket))
        if cls.is_gamma(params):
            return [norms, Section("levels", torch.uint8, varlen.max_nbytes(numel, s), variable=True)]
        return [norms, Section("levels", torch.uint8, packed_nbytes(numel, bits))]

    @classmethod
    def check_content(cls, packet: Packet) -> None:
        """Norms finite and >= 0; every field <= 2s; padding bits zero."""
        bits, levels, _ = cls.unpack_params(packet.params)
        check_scales(packet, "norms")
        if cls.is_gamma(packet.params):
            varlen.decode(packet.sections["levels"], packet.numel, levels)  # raises if malformed
            return
        packed = packet.sections["levels"]
        if not padding_is_zero(packed, bits, packet.numel):
            raise WireError("section 'levels': padding bits of the last byte are not zero")
        if bits < 8 and 2 * levels >= (1 << bits) - 1:
            return  # every representable field is a valid level
        fields = ops.unpack_bits(packed, bits, packet.numel)
        if fields.numel() and int(fields.max()) > 2 * levels:
            raise WireError(f"section 'levels': field {int(fields.max())} exceeds 2*levels = {2 * levels}")

    def _encode(self, flat: torch.Tensor, params: tuple[int, int], seed: int) -> dict[str, torch.Tensor]:
        bits, s, bucket = self.unpack_params(params)
        norms, levels = ops.qsgd_encode(flat, bits, s, bucket, seed)
        return {"norms": norms, "levels": self._code(levels, flat.numel())}

    def _code(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
        """The ``levels`` section: the packed fields, or their gamma stream."""
        if self.coding == "fixed":
            return packed
        return varlen.encode(ops.unpack_bits(packed, self.bits, numel), self.levels)

    _decode_writes = True

    def _decode_add(self, packet: Packet, out: torch.Tensor) -> None:
        self._decode_into(packet, out, True)

    def _decode_into(self, packet: Packet, out: torch.Tensor, accumulate: bool) -> None:
        bits, s, bucket = self.unpack_params(packet.params)
        packed = packet.sections["levels"]
        if self.is_gamma(packet.params):
            packed = ops.pack_bits(varlen.decode(packed, packet.numel, s), bits)
        ops.qsgd_decode(packet.sections["norms"], packed, bits, s, bucket, out, accumulate)

    has_fused_feedback = True

    def _encode_fused(
        self, flat: torch.Tensor, params: tuple[int, int], seed: int, residual: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        bits, s, bucket = self.unpack_params(params)
        norms, levels = ops.qsgd_encode(flat, bits, s, bucket, seed, residual=residual)
        return {"norms": norms, "levels": self._code(levels, flat.numel())}


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
