"""The specification of the sign codec's kernels: 1 bit per element plus one scale per block.

Bit i is 1 when ``x_i < 0`` (so 0 and -0.0 decode to +scale); a block's scale is its mean
magnitude ``||x_b||_1 / L_b``, summed in float64 in the fixed order of
:func:`~commpress.spec.numerics.tree_sum`, divided by ``L_b`` in float64 and stored in
:func:`~commpress.spec.numerics.scale_dtype`. ``block_size=0`` is one block for the whole tensor.
"""

from __future__ import annotations

import torch

from ..errors import CodecError
from .bitpack import pack_bits_reference, unpack_bits_reference
from .blocks import add_block_values, corrected_input, feed_back
from .numerics import scale_dtype, tree_sum


def n_blocks(numel: int, block_size: int) -> int:
    """Number of scale blocks for ``numel`` elements (``block_size=0``: one block)."""
    if numel == 0:
        return 0
    return 1 if block_size == 0 else -(-numel // block_size)


def encode_reference(
    x: torch.Tensor, block_size: int, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification of ``commpress::sign_encode``: ``(scales, bits)`` of a 1-D tensor.

    With ``residual`` (1-D, ``compute_dtype(x.dtype)``): encode ``w = (x + residual)`` rounded
    to x's dtype and overwrite ``residual`` with ``x + residual - decode(w)``. Raises
    :class:`NonFiniteError` for NaN/Inf in ``w`` and :class:`CodecError` when a scale
    overflows, in both cases before ``residual`` is touched.
    """
    numel = x.numel()
    w, corrected = corrected_input(x, residual)
    size = block_size or numel
    nb = n_blocks(numel, block_size)
    mags = torch.nn.functional.pad(w.abs().double(), (0, nb * size - numel))
    sums = tree_sum(mags.view(nb, size))
    lengths = torch.full((nb,), float(size), dtype=torch.float64, device=x.device)
    if nb:
        lengths[-1] = numel - size * (nb - 1)
    scales = (sums / lengths).to(scale_dtype(x.dtype))
    if nb and not bool(torch.isfinite(scales).all()):
        raise CodecError(f"a block's mean magnitude overflows {scales.dtype} (NaN or Inf scale)")
    bits = pack_bits_reference((w < 0).to(torch.uint8), 1)
    feed_back(
        x, residual, corrected, lambda out: decode_reference(scales, bits, block_size, out, False)
    )
    return scales, bits


def decode_reference(
    scales: torch.Tensor, bits: torch.Tensor, block_size: int, out: torch.Tensor, accumulate: bool = True
) -> None:
    """The specification of ``commpress::sign_decode``: ``out (+)= +-scale`` per element.

    Without ``accumulate`` the result is what adding to zeros gives (a -0 becomes +0).
    """

    def signed(scale: torch.Tensor, numel: int, ct: torch.dtype) -> torch.Tensor:
        negative = unpack_bits_reference(bits, 1, numel).bool()
        return torch.where(negative, -scale, scale)

    add_block_values(out, scales, block_size or out.numel(), accumulate, signed)
