"""The specification of random-k's kernels: stratified indices drawn from a seed, gather and scatter-add.

The tensor is cut into k contiguous strata ``[j*d//k, (j+1)*d//k)`` and one index is drawn
uniformly in each from the counter-based RNG of :mod:`commpress.rng` (stream ``STREAM_RANDOMK``),
so the indices are a pure function of ``(seed, d, k)`` and never travel.
"""

from __future__ import annotations

import torch

from .. import rng
from ..errors import CodecError
from .numerics import require_finite


def block_bounds(numel: int, k: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Return (start, length) of the k strata over ``numel`` elements, as int64 tensors."""
    j = torch.arange(k + 1, dtype=torch.int64, device=device)
    # floor(j * numel / k) without forming j * numel, which would overflow int64 for huge
    # tensors (exact while j * (numel % k) < 2**63, i.e. k < 3e9; the kernels do the same)
    edges = j * (numel // k) + j * (numel % k) // k
    return edges[:-1], edges[1:] - edges[:-1]


def random_indices(seed: int, numel: int, k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The k sorted indices random-k keeps for ``(seed, numel, k)`` (int64)."""
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    start, length = block_bounds(numel, k)
    offsets = rng.below(seed, rng.STREAM_RANDOMK, length)
    return (start + offsets).to(device)


def gather_reference(x: torch.Tensor, k: int, seed: int, scaled: bool) -> torch.Tensor:
    """The specification of ``commpress::randomk_gather``: the k values random-k sends."""
    require_finite(x)
    numel = x.numel()
    if k and -(-numel // k) >= 1 << 32:
        raise CodecError(f"randomk: k={k} is too small for numel={numel} (blocks > 2**32)")
    idx = random_indices(seed, numel, k, x.device)
    values = x[idx]
    if scaled and k:
        _, length = block_bounds(numel, k, x.device)
        values = values * length.to(values.dtype)
        if not bool(torch.isfinite(values).all()):  # fp16 can overflow here
            raise CodecError(f"randomk: x scaled by its block length overflows {x.dtype}; use scaled=False")
    return values


def scatter_add_reference(values: torch.Tensor, seed: int, out: torch.Tensor) -> None:
    """The specification of ``commpress::randomk_scatter_add``: ``out[idx] += values``."""
    idx = random_indices(seed, out.numel(), values.numel(), out.device)
    out.index_add_(0, idx, values)
