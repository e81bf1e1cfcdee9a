"""The specification of top-k's kernels: exact selection, and the sparse scatter-add.

Selection keeps every element above the k-th largest magnitude, then the lowest-index ones
equal to it, indices ascending. The scatter-add adds many ``(indices, values)`` payloads into
one dense output; :func:`sorted_in_range` is the one rule its indices follow (and top-k's wire
check): strictly increasing, so no duplicates, and inside ``[0, numel)``. Arguments arrive
checked by :mod:`commpress.kernels.checks` (dtypes, shapes, devices), as for every backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..dtypes import index_dtype
from ..errors import CodecError, KernelArgumentError
from .numerics import require_finite


def select_reference(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification of ``commpress::topk_select``: ``(indices, values)`` of the k largest |x|.

    Exact: every element above the k-th largest magnitude, then the lowest-index elements equal
    to it; indices ascending (int32, or int64 past 2**31 - 1 elements), values copied from x.
    """
    require_finite(x)
    numel = x.numel()
    if not 0 <= k <= numel:
        raise CodecError(f"topk_select: k must be in [0, numel={numel}], got {k}")
    if k == 0:
        return torch.empty(0, dtype=index_dtype(numel), device=x.device), x[:0].clone()
    mags = x.abs()
    kth = torch.topk(mags, k, sorted=False).values.min()
    above = (mags > kth).nonzero().view(-1)
    equal = (mags == kth).nonzero().view(-1)[: k - above.numel()]
    idx = torch.sort(torch.cat([above, equal])).values
    return idx.to(index_dtype(numel)), x[idx]


def sorted_in_range(idx: torch.Tensor, numel: int) -> bool:
    """True when the 1-D ``idx`` is strictly increasing (no duplicates) and inside ``[0, numel)``.

    A strictly increasing sequence is in range when its ends are, so this reads ``idx`` once.
    """
    if not idx.numel():
        return True
    if int(idx[0]) < 0 or int(idx[-1]) >= numel:
        return False
    return idx.numel() < 2 or bool((idx[1:] > idx[:-1]).all())


def first_bad_index(idx: torch.Tensor, numel: int) -> int:
    """Position of the first index outside ``[0, numel)`` or not above its predecessor; -1 if none."""
    bad = (idx < 0) | (idx >= numel)
    if idx.numel() > 1:
        bad[1:] |= idx[1:] <= idx[:-1]
    hits = bad.nonzero()
    return int(hits[0]) if hits.numel() else -1


def bad_index(p: int, j: int, value: int, previous: int, n: int) -> KernelArgumentError:
    """The error for the first invalid index ``indices[p][j]`` of a sparse scatter-add (every backend's wording)."""
    op = "sparse_scatter_add"
    if not 0 <= value < n:
        return KernelArgumentError(f"{op}: indices[{p}][{j}] = {value} is out of range [0, {n})")
    return KernelArgumentError(
        f"{op}: indices[{p}] must be strictly increasing (no duplicates): indices[{p}][{j}] = {value} follows {previous}"
    )


def scatter_add_reference(indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """The specification of ``commpress::sparse_scatter_add``: ``out[idx] += values``, payload by payload.

    Every payload's indices are checked (:func:`sorted_in_range`) before anything is written.
    """
    n = out.numel()
    for p, idx in enumerate(indices):
        if not sorted_in_range(idx, n):
            j = first_bad_index(idx, n)
            raise bad_index(p, j, int(idx[j]), int(idx[j - 1]) if j else 0, n)
    for idx, val in zip(indices, values):
        out.index_add_(0, idx.long(), val)
