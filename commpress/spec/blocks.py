"""The shared shape of the block codecs' reference encoders and decoders (sign, QSGD).

Both encode with optional fused error feedback: :func:`corrected_input` owns what is encoded
(``x``, or ``x + residual`` rounded to x's dtype, NaN/Inf refused before anything is written)
and :func:`feed_back` the residual update after encoding (``residual = x + residual -
decode(w)``). Both decode one value per block (a sign scale, a QSGD norm) spread over the
block's elements and combined with a per-element field; :func:`add_block_values` owns the part
they share -- zero the output unless accumulating, nothing to do for an empty output, spread
the per-block value in the compute dtype, add in the output dtype -- so the two specifications
differ only in how a field scales the block's value.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import NonFiniteError
from .numerics import compute_dtype


def corrected_input(
    x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(w, corrected)``: the values to encode, and ``x + residual`` in the compute dtype.

    Without ``residual``: ``(x, None)``. Raises :class:`NonFiniteError` for NaN/Inf in ``w``.
    """
    if residual is None:
        corrected, w = None, x
    else:
        corrected = x.to(compute_dtype(x.dtype)) + residual
        w = corrected.to(x.dtype)
    if x.numel() and not bool(torch.isfinite(w).all()):
        what = "x" if residual is None else "x + residual"
        raise NonFiniteError(f"{what} contains NaN or Inf; commpress does not encode non-finite values")
    return w, corrected


def feed_back(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    corrected: torch.Tensor | None,
    decode: Callable[[torch.Tensor], None],
) -> None:
    """``residual = corrected - decode(w)``; nothing without a residual.

    ``decode(out)`` writes the decoded ``w`` into ``out`` (x's dtype and size).
    """
    if residual is None or corrected is None:
        return
    decoded = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
    decode(decoded)
    residual.copy_(corrected.sub_(decoded.to(compute_dtype(x.dtype))))


def add_block_values(
    out: torch.Tensor,
    per_block: torch.Tensor,
    block: int,
    accumulate: bool,
    values: Callable[[torch.Tensor, int, torch.dtype], torch.Tensor],
) -> None:
    """``out (+)= values(per_element, numel, ct)`` with ``per_block`` repeated ``block`` times.

    ``per_element`` holds each element's block value in the compute dtype ``ct`` of ``out``;
    the sum is rounded to ``out``'s dtype. Without ``accumulate`` the result is what adding to
    zeros gives (a -0 becomes +0).
    """
    numel = out.numel()
    if not accumulate:
        out.zero_()
    if numel == 0:
        return
    ct = compute_dtype(out.dtype)
    per_element = per_block.to(ct).repeat_interleave(block)[:numel]
    out.add_(values(per_element, numel, ct).to(out.dtype))
