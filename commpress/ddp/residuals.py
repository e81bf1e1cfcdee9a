"""A DDP state's error-feedback residuals seen per parameter: their pieces, flushing them into a dense step, norms.

Residuals are keyed per parameter piece (the algorithm's ``residual_layout``; two-phase also
keeps server pieces), never per bucket: DDP rebuilds its buckets after the first step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import comm
from .planning import BucketPlan, ParamPlan

if TYPE_CHECKING:
    from .state import CompressionState


def _norm_sq(x: torch.Tensor) -> float:
    """``||x||^2`` in one read of ``x`` (``x.square().sum()`` wrote a temporary: ~30 ms at 67 MB)."""
    return float(torch.linalg.vector_norm(x, dtype=torch.float32 if x.dtype != torch.float64 else None)) ** 2


def flush(state: CompressionState, plan: BucketPlan, buffer: torch.Tensor) -> None:
    """Add this rank's residuals into a dense step's gradients and zero them (nothing lost).

    Worker residuals are this rank's own; a two-phase server residual is an average already,
    so it is added ``world_size`` times before the dense all-reduce divides by it.
    """
    if state.feedback is None:
        return
    for p, off in zip(plan.params, plan.offsets):
        if not p.compressed:
            continue
        for lo, hi, e in pieces(state, p):
            buffer[off + lo : off + hi].add_(e.reshape(-1).to(buffer.dtype))
            e.zero_()
        if state.server_feedback is not None:
            for piece in comm.get(state.algorithm).server_layout(
                p.name, p.shape, state.codec, state.world_size, state.rank
            ):
                server_e = state.server_feedback.residual(piece.key)
                if server_e is not None:
                    buffer[off + piece.lo : off + piece.hi].add_(
                        server_e.reshape(-1).to(buffer.dtype), alpha=state.world_size
                    )
                    server_e.zero_()


def norms_sq(state: CompressionState, plan: BucketPlan, buffer: torch.Tensor | None) -> float:
    """Squared norm of the compressed parameters' input in ``buffer``, or of their residuals."""
    total = 0.0
    for p, off in zip(plan.params, plan.offsets):
        if not p.compressed:
            continue
        if buffer is not None:
            total += _norm_sq(buffer[off : off + p.numel])
        else:
            total += sum(_norm_sq(e) for _, _, e in pieces(state, p))
    return total


def pieces(state: CompressionState, plan: ParamPlan) -> list[tuple[int, int, torch.Tensor]]:
    """``(start, stop, residual)`` of each piece of a parameter's flat residual."""
    if state.feedback is None:
        return []
    pieces = comm.get(state.algorithm).residual_layout(plan.name, plan.shape, state.codec, state.world_size)
    found = [(piece.lo, piece.hi, state.feedback.residual(piece.key)) for piece in pieces]
    return [(lo, hi, e) for lo, hi, e in found if e is not None]


def residual(state: CompressionState, name: str) -> torch.Tensor | None:
    """The worker-side residual of parameter ``name`` (None before its first step)."""
    plan = state.plans.get(name)
    if plan is None or not plan.compressed:
        return None
    found = pieces(state, plan)
    if len(found) != len(comm.get(state.algorithm).residual_layout(plan.name, plan.shape, state.codec, state.world_size)):
        return None  # before its first step
    if len(found) == 1:
        return found[0][2].view(plan.shape)
    return torch.cat([e.reshape(-1) for _, _, e in found]).view(plan.shape)
