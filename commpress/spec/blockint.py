"""The specification of the block-scaled integer codecs ``int8`` / ``int4`` (ZeRO++ qwZ style).

Deterministic, symmetric quantisation of a 1-D tensor in blocks of ``block_size`` consecutive
elements (the last block may be shorter), with ``q_max = 127`` (8 bits) or ``7`` (4 bits):

    ct      = compute_dtype(x.dtype)                 (float32; float64 for float64 input)
    s_b     = max_i |x_i| / q_max          in ct      (one scale per block; 0 for an all-zero block)
    q_i     = clamp(rne(x_i / s_b), -q_max, q_max)    (rne: round half to even; q_i = 0 when s_b = 0)
    field_i = q_i + q_max                             (unsigned, 0 .. 2 q_max; 255 / 15 never occur)
    decode: x_i' = q_i * s_b in ct, rounded to x's dtype

``x_i`` is converted to ``ct`` exactly, every operation is one IEEE operation in ``ct`` (the
division, the product), ``rne`` is ``torch.round``. Fields are bit-packed LSB-first in
``bits``-wide fields (:mod:`.bitpack`; two 4-bit values per byte, the first in the low nibble).

Error bound (checked by tests/codecs/test_blockint.py): with ``u`` the unit roundoff of ``ct``
(``2**-24``; ``2**-53``), ``u_out`` that of the output dtype (0 when it is ``ct``: ``2**-8`` for
bfloat16, ``2**-11`` for float16) and ``m`` the smallest positive subnormal of ``ct``,

    |x_i' - x_i| <= s_b * (1/2 + 2 q_max u) + q_max * m + u_out * |x_i'|

i.e. half a quantisation step, plus the roundings of the division and the product, plus an
absolute floor for blocks so small their scale is subnormal or underflows, plus the final
rounding to a 16-bit output. An all-zero block decodes to zeros; a block whose values are
``k_i * s`` with integers ``|k_i| <= q_max``, some ``|k_i| = q_max``, and ``q_max * s`` exact
in ``ct`` decodes exactly. Re-encoding a decoded float32/float64 tensor gives the same packet
(idempotence: ``q_max * s_b`` divided by ``q_max`` rounds back to ``s_b``); a float16/bfloat16
decode is rounded off the grid, so there it need not.

**Stochastic rounding** (:func:`encode_stochastic_reference`, the op ``blockint_encode_sr``; the
FSDP error-feedback store keeps residuals and velocities in it): the same scales, and per element,
in 24-bit fixed point like QSGD,

    r_i     = clamp(x_i / s_b, -q_max, q_max)          in ct (the division as above; 0 when s_b = 0)
    T_i     = floor(r_i * 2**24)                        (exact: a power-of-two product; |T_i| <= q_max 2**24)
    field_i = floor((T_i + v_i) / 2**24) + q_max,  v_i = rng.paired_u24(seed, STREAM_BLOCKINT_SR, numel)[i]

so ``field_i - q_max`` is ``floor(T_i / 2**24)`` plus one with probability ``(T_i mod 2**24) / 2**24``:
``E[q_i] = T_i / 2**24``, within ``2**-24`` of ``r_i`` (unbiased up to that, where nearest
rounding drops every ``|r_i| < 1/2`` for good), ``|q_i - r_i| < 1``, and the field lies in
``[0, 2 q_max]`` with no clamp after the rounding. The decode is :func:`decode_reference`'s.

NaN or Inf input raises :class:`~commpress.errors.NonFiniteError`; input so close to the
dtype's largest value that ``q_max * s_b`` would not be finite in it raises :class:`CodecError`
(the decode would overflow), which is also what the wire check refuses.
"""

from __future__ import annotations

import torch

from .. import rng
from ..errors import CodecError
from .bitpack import pack_bits_reference, packed_nbytes, unpack_bits_reference
from .blocks import add_block_values
from .numerics import compute_dtype, require_finite, scale_dtype

#: Field width -> largest level magnitude.
QMAX = {8: 127, 4: 7}
#: Elements per scale block by default (one float32 scale per 256 elements: 1/64 byte each).
DEFAULT_BLOCK = 256


def n_blocks(numel: int, block_size: int) -> int:
    """Number of scale blocks for ``numel`` elements."""
    return -(-numel // block_size) if numel else 0


def wire_nbytes(numel: int, bits: int, block_size: int, dtype: torch.dtype = torch.float32) -> int:
    """Payload bytes (scales + packed fields, no wire header or padding) for ``numel`` elements."""
    scale_bytes = torch.empty((), dtype=scale_dtype(dtype)).element_size()
    return n_blocks(numel, block_size) * scale_bytes + packed_nbytes(numel, bits)


def error_bound(scales: torch.Tensor, block_size: int, numel: int, bits: int, dtype: torch.dtype,
                decoded: torch.Tensor) -> torch.Tensor:
    """The stated per-element bound on ``|decode(encode(x)) - x|`` (float64, one per element)."""
    ct = compute_dtype(dtype)
    qmax = QMAX[bits]
    u = torch.finfo(ct).eps / 2
    m = 2.0 ** (-149 if ct == torch.float32 else -1074)
    u_out = 0.0 if dtype == ct else torch.finfo(dtype).eps / 2
    s = scales.double().repeat_interleave(block_size)[:numel]
    return s * (0.5 + 2 * qmax * u) + qmax * m + u_out * decoded.double().abs()


def check_decodable(scales: torch.Tensor, bits: int, dtype: torch.dtype) -> bool:
    """True when the largest decoded magnitude, ``q_max * max(s)`` rounded to ``dtype``, is finite."""
    if not scales.numel():
        return True
    top = scales.max() * QMAX[bits]  # in the scales' (compute) dtype, as decode computes it
    return bool(torch.isfinite(top)) and bool(torch.isfinite(top.to(dtype)))


def _quotients(x: torch.Tensor, bits: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, x / safe)``: the block scales in the compute dtype and the ``(blocks, block_size)`` quotients."""
    if bits not in QMAX:
        raise CodecError(f"bits must be one of {sorted(QMAX)}, got {bits!r}")
    require_finite(x)
    numel = x.numel()
    ct = compute_dtype(x.dtype)
    nb = n_blocks(numel, block_size)
    rows = torch.nn.functional.pad(x.to(ct), (0, nb * block_size - numel)).view(nb, block_size)
    scales = rows.abs().amax(dim=1) / QMAX[bits] if nb else rows.new_zeros(0)
    if not check_decodable(scales, bits, x.dtype):
        raise CodecError(f"values too close to {x.dtype}'s largest value: the decode of int{bits} would overflow")
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    return scales, rows / safe[:, None]


def encode_reference(x: torch.Tensor, bits: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, packed)`` of a 1-D tensor: the specification every fast path matches bit for bit."""
    scales, r = _quotients(x, bits, block_size)
    qmax = QMAX[bits]
    fields = (torch.round(r).clamp_(-qmax, qmax) + qmax).to(torch.uint8).reshape(-1)[: x.numel()]
    return scales.to(scale_dtype(x.dtype)), pack_bits_reference(fields, bits)


def encode_stochastic_reference(x: torch.Tensor, bits: int, block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, packed)`` with stochastic rounding (the module docstring): what ``blockint_encode_sr`` matches bit for bit."""
    scales, r = _quotients(x, bits, block_size)
    qmax = QMAX[bits]
    numel = x.numel()
    r = r.clamp(-qmax, qmax)
    fixed = torch.floor(r * float(1 << 24)).reshape(-1)[:numel].to(torch.int64)
    v = torch.from_numpy(rng.paired_u24(seed, rng.STREAM_BLOCKINT_SR, numel).astype("int64")).to(x.device)
    fields = ((fixed + v) >> 24) + qmax  # arithmetic shift: floor((T + v) / 2**24) + q_max
    return scales.to(scale_dtype(x.dtype)), pack_bits_reference(fields.to(torch.uint8), bits)


def decode_reference(
    scales: torch.Tensor, packed: torch.Tensor, bits: int, block_size: int, out: torch.Tensor,
    accumulate: bool = False,
) -> None:
    """``out (+)= q_i * s_b``, the product in the compute dtype rounded to ``out``'s dtype."""
    qmax = QMAX[bits]
    fields = unpack_bits_reference(packed, bits, out.numel())

    def values(scale: torch.Tensor, numel: int, ct: torch.dtype) -> torch.Tensor:
        return (fields.to(ct) - qmax) * scale

    add_block_values(out, scales, block_size, accumulate, values)
