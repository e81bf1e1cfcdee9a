"""The shared shape of the block codecs' reference decoders (sign, QSGD).

Both decode one value per block (a sign scale, a QSGD norm) spread over the block's
elements and combined with a per-element field; :func:`add_block_values` owns the part they
share -- zero the output unless accumulating, nothing to do for an empty output, spread the
per-block value in the compute dtype, add in the output dtype -- so the two specifications
differ only in how a field scales the block's value.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .base import compute_dtype


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
