"""Which parameters travel compressed and which stay dense, decided once at registration.

Tiny tensors and 1-D tensors (biases, norm scales) cost almost nothing to send dense, while
compressing them hurts most (a top-1% of a 64-element bias is one number; one sign scale per
LayerNorm mixes unrelated channels). The default rule therefore compresses a parameter only
when it has at least two dimensions and ``min_numel`` elements; ``compress_filter`` replaces
the rule entirely. Plans are keyed by parameter name, never by DDP bucket: DDP rebuilds its
buckets after the first step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..codecs import Codec, NoneCodec
from ..comm import Algorithm, Slot
from ..errors import CodecError
from ..feedback import ErrorFeedback
from ..selection import CompressFilter, SelectionRule


@dataclass(frozen=True)
class ParamPlan:
    """How one parameter is communicated: its name, position, shape, dtype and codec."""

    name: str
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    compressed: bool

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


def default_rule(min_numel: int, dense_1d: bool) -> CompressFilter:
    """The default filter: :class:`commpress.selection.SelectionRule`, shared with the parameter server."""
    rule = SelectionRule(min_numel, dense_1d)
    return lambda name, p: rule(name, tuple(p.shape), p.numel())


def plan_parameters(
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
    codec: Codec,
    *,
    min_numel: int = 1024,
    dense_1d: bool = True,
    compress_filter: CompressFilter | None = None,
) -> tuple[dict[int, ParamPlan], dict[str, ParamPlan]]:
    """Plan every trainable parameter; return plans by ``id(parameter)`` and by name.

    The index is the parameter's position in ``named_parameters`` (the same on every rank),
    used to derive per-parameter seeds. Raises :class:`CodecError` when the codec cannot encode
    a parameter it is asked to compress (e.g. top-k with ``k`` larger than the tensor).
    """
    if not isinstance(min_numel, int) or isinstance(min_numel, bool) or min_numel < 0:
        raise CodecError(f"min_numel must be an int >= 0, got {min_numel!r}")
    if compress_filter is not None and not callable(compress_filter):
        raise CodecError(f"compress_filter must be callable(name, parameter) -> bool, got {compress_filter!r}")
    rule = compress_filter or default_rule(min_numel, dense_1d)
    by_id: dict[int, ParamPlan] = {}
    by_name: dict[str, ParamPlan] = {}
    for index, (name, p) in enumerate(named_parameters):
        if not p.requires_grad:
            continue
        compressed = not isinstance(codec, NoneCodec) and p.numel() > 0 and bool(rule(name, p))
        if compressed:
            try:
                codec.wire_size(p.numel(), p.dtype)
                codec.wire_params(p.numel())
            except CodecError as exc:
                raise CodecError(f"parameter {name!r} ({tuple(p.shape)}): {exc}") from None
        plan = ParamPlan(name, index, tuple(p.shape), p.dtype, compressed)
        by_id[id(p)] = plan
        by_name[name] = plan
    return by_id, by_name


def feedback_shapes(
    plans: Iterable[ParamPlan], algorithm: Algorithm, codec: Codec, world_size: int, rank: int | None = None
) -> dict[str, tuple[int, ...]]:
    """Keys and shapes of error-feedback residuals for the compressed parameters.

    The algorithm says which residuals it needs (:meth:`Algorithm.residual_layout`: one per
    parameter, or one per piece); with ``rank`` given, the server-side ones that rank owns.
    """
    out: dict[str, tuple[int, ...]] = {}
    for plan in plans:
        if not plan.compressed:
            continue
        pieces = (
            algorithm.residual_layout(plan.name, plan.shape, codec, world_size)
            if rank is None
            else algorithm.server_layout(plan.name, plan.shape, codec, world_size, rank)
        )
        out.update((piece.key, piece.shape) for piece in pieces)
    return out


@dataclass(frozen=True)
class BucketPlan:
    """The parameters of one DDP bucket, in buffer order, with their offsets."""

    params: tuple[ParamPlan, ...]
    offsets: tuple[int, ...]
    numel: int

    def slots(self, codec: Codec, seeds: Sequence[int], feedback: ErrorFeedback | None) -> list[Slot]:
        """Collective slots for this bucket; ``seeds`` in parameter order."""
        dense = NoneCodec()
        return [
            Slot(
                key=p.name, offset=off, shape=p.shape, codec=codec if p.compressed else dense,
                seed=seed, feedback=feedback if p.compressed else None,
            )
            for p, off, seed in zip(self.params, self.offsets, seeds)
        ]


def plan_bucket(params: Sequence[torch.Tensor], by_id: dict[int, ParamPlan], buffer_numel: int) -> BucketPlan:
    """Map a bucket's parameters to their plans and offsets; check they tile the buffer."""
    plans: list[ParamPlan] = []
    offsets: list[int] = []
    off = 0
    for p in params:
        plan = by_id.get(id(p))
        if plan is None:
            raise CodecError(
                f"bucket holds a parameter {tuple(p.shape)} that was not registered; "
                "create the CompressionState from the DDP model it is used with"
            )
        plans.append(plan)
        offsets.append(off)
        off += plan.numel
    if off != buffer_numel:
        raise CodecError(f"bucket parameters hold {off} elements, its buffer {buffer_numel}")
    return BucketPlan(tuple(plans), tuple(offsets), off)
