"""``randomk``: keep k entries drawn from a seed; only the values travel.

Index choice is *stratified*: the tensor is cut into k contiguous blocks
``[j*d//k, (j+1)*d//k)`` (lengths L_j = d/k rounded down or up) and one index is drawn
uniformly in each block from the counter-based RNG of :mod:`commpress.rng` (stream
``STREAM_RANDOMK``). The indices are therefore a pure function of ``(seed, d, k)``: every rank
using one seed draws the same ones (so the values can be all-reduced directly), and the
decoder regenerates them instead of reading them off the wire.

- ``scaled=True`` (default): values are multiplied by their block length L_j, making the codec
  unbiased, ``E[C(x)] = x``; use it without error feedback.
- ``scaled=False``: values are sent as they are; biased, contractive in expectation with
  ``delta = 1 / max_j L_j`` (about k/d); the form to use with error feedback.

Wire: ``values`` (k x input dtype); ``param0 = k``, ``param1 = scaled``; the seed is in the header.

Kernels: ``gather_reference`` / ``scatter_add_reference`` (:mod:`commpress.spec.randomk`) are the specification;
``commpress.kernels.ops.randomk_gather`` / ``randomk_scatter_add`` run native kernels that regenerate
each index from the seed in place (no index tensor is built), bit-identical to them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..errors import CodecError, WireError
from ..kernels import ops
from ..spec.randomk import block_bounds, gather_reference, random_indices, scatter_add_reference
from ..wire.packet import Packet, Section
from .base import Codec, check_finite_section, check_ratio_k, ratio_to_k

__all__ = ["RandomKCodec", "block_bounds", "gather_reference", "random_indices", "scatter_add_reference"]

logger = logging.getLogger("commpress")


class RandomKCodec(Codec):
    """Random-k sparsification with shared-seed indices. Give ``ratio`` or ``k``; see module doc."""

    name = "randomk"
    codec_id = 5
    stochastic = True
    summable = True  # every rank draws the same indices from the shared seed
    value_blind = True  # indices come from the seed alone

    def __init__(self, ratio: float | None = None, k: int | None = None, scaled: bool = True) -> None:
        # Scaling by d/k makes the estimate unbiased but multiplies its variance by ~d/k (100x at
        # ratio 0.01). The parameter server (error feedback on pushes, momentum on the server)
        # needs it: unscaled, random-k there ended at 65% on digits (tests/test_ps_mpi.py, uncompressed
        # 96.4%; scaled stays within its 2-point bound). The DDP hook,
        # whose error feedback holds the momentum, defaults to unscaled (ddp/state.py).
        check_ratio_k(ratio, k, self.name)
        if not isinstance(scaled, bool):
            raise CodecError(f"randomk: scaled must be a bool, got {scaled!r}")
        if scaled and ratio is not None and ratio < 0.1:
            logger.warning(
                "commpress: scaled random-k at ratio %g multiplies the gradient's variance by ~%.0fx; "
                "training may diverge (in DDP use scaled=False with error feedback, its default)",
                ratio, 1 / ratio,
            )
        self.ratio = None if ratio is None else float(ratio)
        self.k = k
        self.scaled = scaled

    def summable_values(self, packet: Packet) -> torch.Tensor:
        """The k values (their indices follow from the seed, the same on every rank)."""
        return packet.sections["values"]

    def sent_indices(self, packet: Packet) -> torch.Tensor:
        """The indices of the packet's seed (drawn again: the wire carries none)."""
        return random_indices(packet.seed, packet.numel, packet.params[0], packet.sections["values"].device)

    def packet_from_values(self, values: torch.Tensor, numel: int, dtype: torch.dtype, seed: int) -> Packet:
        """A packet holding summed ``values`` at the indices of ``seed``."""
        return Packet(self.name, dtype, numel, self.wire_params(numel), seed, {"values": values})

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        """Unbiased only in the scaled form."""
        return self.scaled

    def config(self) -> dict[str, Any]:
        """Return ``{"name": "randomk", "ratio": ..., "k": ..., "scaled": ...}``."""
        return {"name": self.name, "ratio": self.ratio, "k": self.k, "scaled": self.scaled}

    def k_for(self, numel: int) -> int:
        """Number of entries kept for a tensor of ``numel`` elements."""
        return ratio_to_k(self.ratio, self.k, numel, self.name)

    def delta(self, numel: int) -> float | None:
        """Unscaled: ``1 / ceil(numel / k)`` in expectation. Scaled: not contractive (None)."""
        if self.scaled:
            return None
        k = self.k_for(numel)
        return 1.0 / -(-numel // k) if numel else 1.0

    def wire_params(self, numel: int) -> tuple[int, int]:
        """``(k, scaled)``."""
        return (self.k_for(numel), int(self.scaled))

    @classmethod
    def check_wire_params(cls, numel: int, params: tuple[int, int]) -> None:
        """``1 <= k <= numel`` (0 for an empty tensor) and a 0/1 ``scaled`` flag below 2**32 blocks."""
        k, scaled = params
        if k > numel or (numel > 0 and k < 1):
            raise WireError(f"params.k: k={k} is not in [1, numel={numel}]")
        if k and -(-numel // k) >= 1 << 32:
            raise WireError(f"params.k: blocks of numel/k = {numel // k} elements exceed 2**32")
        if scaled not in (0, 1):
            raise WireError(f"params.scaled: must be 0 or 1, got {scaled}")

    @classmethod
    def layout(cls, numel: int, dtype: torch.dtype, params: tuple[int, int]) -> list[Section]:
        """``values`` (k x input dtype)."""
        return [Section("values", dtype, params[0])]

    @classmethod
    def check_content(cls, packet: Packet) -> None:
        """Values must be finite."""
        check_finite_section(packet, "values")

    def _encode(self, flat: torch.Tensor, params: tuple[int, int], seed: int) -> dict[str, torch.Tensor]:
        k, scaled = params
        return {"values": ops.randomk_gather(flat, k, seed, bool(scaled))}

    sparse = True

    def _decode_add(self, packet: Packet, out: torch.Tensor) -> None:
        ops.randomk_scatter_add(packet.sections["values"].to(out.dtype), packet.seed, out)
