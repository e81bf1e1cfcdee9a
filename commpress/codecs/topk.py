"""``topk``: keep the k entries of largest magnitude, send (indices, values).

Properties: deterministic, biased, contractive with ``delta = k / d``:
``||C(x) - x||^2 <= (1 - k/d) ||x||^2`` because the dropped d - k entries are the smallest.
Indices are sent sorted ascending (one canonical byte form per input); ties in magnitude at
the k-th largest are broken toward the lower index, so the selection is a pure function of the
input, identical on every backend.

Kernels: ``select_reference`` (``torch.topk`` for the k-th magnitude, then the tie rule)
and ``scatter_add_reference`` (:mod:`commpress.spec.topk`) are the specification; ``commpress.kernels.ops.topk_select`` runs the
native sampled-threshold selection (CPU) or radix selection (CUDA), exact and bit-identical, and
``commpress.kernels.ops.sparse_scatter_add`` adds many (indices, values) payloads into one dense output
(the gather side of a sparse collective), bounds- and duplicate-checked.
Wire: ``indices`` (int32, or int64 past 2**31 - 1 elements) then ``values`` (input dtype);
``param0 = k``. Cost: k * (4 + itemsize) bytes plus the 56-byte header.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import WireError
from ..kernels import ops
from ..spec.topk import first_bad_index, scatter_add_reference, select_reference, sorted_in_range
from ..wire.packet import Packet, Section
from .base import Codec, check_finite_section, check_ratio_k, index_dtype, ratio_to_k

__all__ = ["TopKCodec", "scatter_add_reference", "select_reference"]


class TopKCodec(Codec):
    """Top-k sparsification. Give ``ratio`` (fraction of entries kept, in (0, 1]) or ``k``."""

    name = "topk"
    codec_id = 4

    def __init__(self, ratio: float | None = None, k: int | None = None) -> None:
        check_ratio_k(ratio, k, self.name)
        self.ratio = None if ratio is None else float(ratio)
        self.k = k

    def config(self) -> dict[str, Any]:
        """Return ``{"name": "topk", "ratio": ..., "k": ...}``."""
        return {"name": self.name, "ratio": self.ratio, "k": self.k}

    def k_for(self, numel: int) -> int:
        """Number of entries kept for a tensor of ``numel`` elements."""
        return ratio_to_k(self.ratio, self.k, numel, self.name)

    def delta(self, numel: int) -> float | None:
        """``k / numel`` (1 for an empty tensor)."""
        return self.k_for(numel) / numel if numel else 1.0

    def wire_params(self, numel: int) -> tuple[int, int]:
        """``(k, 0)``."""
        return (self.k_for(numel), 0)

    @classmethod
    def check_wire_params(cls, numel: int, params: tuple[int, int]) -> None:
        """``k <= numel``, ``k >= 1`` unless the tensor is empty, ``param1 == 0``."""
        k, p1 = params
        if k > numel or (numel > 0 and k < 1):
            raise WireError(f"params.k: k={k} is not in [1, numel={numel}]")
        if p1 != 0:
            raise WireError(f"params[1]: must be 0 for topk, got {p1}")

    @classmethod
    def layout(cls, numel: int, dtype: torch.dtype, params: tuple[int, int]) -> list[Section]:
        """``indices`` (k x int32/int64) and ``values`` (k x input dtype)."""
        k = params[0]
        return [Section("indices", index_dtype(numel), k), Section("values", dtype, k)]

    @classmethod
    def check_content(cls, packet: Packet) -> None:
        """Indices strictly increasing (so no duplicates) and in ``[0, numel)``; values finite."""
        idx = packet.sections["indices"]
        if not sorted_in_range(idx, packet.numel):
            value = int(idx[first_bad_index(idx, packet.numel)])
            if not 0 <= value < packet.numel:
                raise WireError(f"section 'indices': index out of range [0, {packet.numel})")
            raise WireError("section 'indices': indices must be strictly increasing (sorted, no duplicates)")
        check_finite_section(packet, "values")

    def _encode(self, flat: torch.Tensor, params: tuple[int, int], seed: int) -> dict[str, torch.Tensor]:
        indices, values = ops.topk_select(flat, params[0])
        return {"indices": indices, "values": values}

    sparse = True

    def sent_indices(self, packet: Packet) -> torch.Tensor:
        """The packet's ``indices`` section (int64)."""
        return packet.sections["indices"].long()

    def _decode_add(self, packet: Packet, out: torch.Tensor) -> None:
        ops.sparse_scatter_add([packet.sections["indices"]], [packet.sections["values"]], out)
