"""The error-feedback memory of a DDP state, seen per parameter: pieces, flushing into a dense step, norms.

Residuals are keyed per parameter piece (the algorithm's ``residual_layout``; the two-phase
algorithm also keeps server pieces), never per bucket: DDP rebuilds its buckets after the first
step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import comm
from ..codecs import Codec
from ..feedback import ErrorFeedback
from .planning import BucketPlan, ParamPlan, feedback_shapes


def _norm_sq(x: torch.Tensor) -> float:
    """``||x||^2`` in one read of ``x`` (``x.square().sum()`` wrote a temporary: ~30 ms at 67 MB)."""
    return float(torch.linalg.vector_norm(x, dtype=torch.float32 if x.dtype != torch.float64 else None)) ** 2


class ParamResiduals:
    """The worker residuals (and two-phase server residuals) of this rank's compressed parameters.

    ``plans=None``: no error feedback (``worker`` and ``server`` are None and every method is a no-op).
    """

    __slots__ = ("codec", "algorithm", "world_size", "rank", "worker", "server")

    def __init__(self, codec: Codec, algorithm: str | comm.Algorithm, world_size: int, rank: int,
                 plans: Sequence[ParamPlan] | None) -> None:
        # a name, or the instance the state runs (a hierarchical one is bound to the node layout)
        self.algorithm = algorithm if isinstance(algorithm, comm.Algorithm) else comm.get(algorithm)
        self.codec, self.world_size, self.rank = codec, world_size, rank
        self.worker: ErrorFeedback | None = None
        self.server: ErrorFeedback | None = None
        if plans is None:
            return
        layout = self.algorithm
        self.worker = ErrorFeedback(codec, feedback_shapes(list(plans), layout, codec, world_size))
        if layout.server_feedback:
            self.server = ErrorFeedback(codec, feedback_shapes(list(plans), layout, codec, world_size, rank))

    def pieces(self, plan: ParamPlan) -> list[tuple[int, int, torch.Tensor]]:
        """``(start, stop, residual)`` of each piece of a parameter's flat residual."""
        if self.worker is None:
            return []
        layout = self.algorithm.residual_layout(plan.name, plan.shape, self.codec, self.world_size)
        found = [(piece.lo, piece.hi, self.worker.residual(piece.key)) for piece in layout]
        return [(lo, hi, e) for lo, hi, e in found if e is not None]

    def flush(self, plan: BucketPlan, buffer: torch.Tensor) -> None:
        """Add this rank's residuals into a dense step's gradients and zero them (nothing lost).

        Worker residuals are this rank's own; a two-phase server residual is an average already,
        so it is added ``world_size`` times before the dense all-reduce divides by it (the
        algorithm's :meth:`~commpress.comm.Algorithm.flush_weights`: a hierarchical worker residual
        is of its node's mean, added ``L`` times).
        """
        if self.worker is None:
            return
        worker_w, server_w = self.algorithm.flush_weights(self.world_size)
        for p, off in zip(plan.params, plan.offsets):
            if not p.compressed:
                continue
            for lo, hi, e in self.pieces(p):
                buffer[off + lo : off + hi].add_(e.reshape(-1).to(buffer.dtype), alpha=worker_w)
                e.zero_()
            if self.server is not None:
                for piece in self.algorithm.server_layout(
                    p.name, p.shape, self.codec, self.world_size, self.rank
                ):
                    server_e = self.server.residual(piece.key)
                    if server_e is not None:
                        buffer[off + piece.lo : off + piece.hi].add_(
                            server_e.reshape(-1).to(buffer.dtype), alpha=server_w
                        )
                        server_e.zero_()

    def norms_sq(self, plan: BucketPlan, buffer: torch.Tensor | None) -> float:
        """Squared norm of the compressed parameters' input in ``buffer``, or of their residuals."""
        total = 0.0
        for p, off in zip(plan.params, plan.offsets):
            if not p.compressed:
                continue
            if buffer is not None:
                total += _norm_sq(buffer[off : off + p.numel])
            else:
                total += sum(_norm_sq(e) for _, _, e in self.pieces(p))
        return total

    def residual(self, plan: ParamPlan) -> torch.Tensor | None:
        """The worker-side residual of a compressed parameter, whole (None before its first step)."""
        found = self.pieces(plan)
        layout = self.algorithm.residual_layout(plan.name, plan.shape, self.codec, self.world_size)
        if len(found) != len(layout):
            return None  # before its first step
        if len(found) == 1:
            return found[0][2].view(plan.shape)
        return torch.cat([e.reshape(-1) for _, _, e in found]).view(plan.shape)


__all__ = ["ParamResiduals"]
