"""The codec interface: encode/decode, exact wire size, stated properties and capabilities.

A codec is a pure function of its input and a seed. Its specification is the pure-torch
reference in :mod:`commpress.spec` that every kernel backend matches; the properties it states
(``unbiased``, contraction ``delta``) are checked by hypothesis tests in tests/. The wire checks
the codecs share (finite sections, scales within the output dtype) live here too.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from .. import rng, wire
from ..dtypes import index_dtype
from ..errors import CodecError, NonFiniteError, WireError
from ..spec.numerics import (
    SUM_CHUNK,
    all_finite,
    compute_dtype,
    require_finite,
    scale_dtype,
    sqrt_rn,
    tree_sum,
)
from ..wire.packet import FLOAT_DTYPE_CODES, Packet, Section

__all__ = [
    "SUM_CHUNK", "Codec", "NonFiniteError", "all_finite", "check_dtype", "check_finite_section", "check_ratio_k",
    "check_scales", "check_values_fit", "compute_dtype", "index_dtype", "ratio_to_k", "require_finite", "scale_dtype",
    "sqrt_rn", "tree_sum",
]


def check_finite_section(packet: Packet, name: str) -> None:
    """Wire check: a value section must hold only finite numbers (encoders never send others)."""
    values = packet.sections[name]
    if not all_finite(values):
        raise WireError(f"section {name!r}: contains NaN or Inf")


def check_scales(packet: Packet, name: str) -> None:
    """Wire check shared by scaled codecs: scales finite, >= 0 and within the output dtype.

    Sign decodes to ``+-scale`` and QSGD to ``norm * (q / s)`` with ``|q / s| <= 1``, so the
    largest decoded magnitude is the largest scale, rounded to the packet's dtype: it is finite
    exactly when the scale is at most ``finfo(dtype).max`` (65504 for float16). The encoders
    never produce more (a mean or norm of finite values of that dtype, and QSGD's encoder
    refuses larger norms), so only hostile packets are rejected.
    """
    scales = packet.sections[name]
    if not scales.numel():
        return
    if not bool((torch.isfinite(scales) & (scales >= 0)).all()):
        raise WireError(f"section {name!r}: scales must be finite and >= 0")
    limit = torch.finfo(packet.dtype).max
    if limit < torch.finfo(scales.dtype).max and float(scales.max()) > limit:
        raise WireError(
            f"section {name!r}: scale {float(scales.max()):.6g} exceeds {packet.dtype}'s largest value "
            f"{limit:.6g} (the decode would overflow)"
        )


def check_values_fit(packet: Packet, name: str) -> None:
    """Wire check: finite values whose conversion to the packet's dtype stays finite.

    Needed where the wire dtype has a wider range than the output (bf16 values decoded into
    float16: anything above 65504 would become Inf).
    """
    check_finite_section(packet, name)
    values = packet.sections[name]
    limit = torch.finfo(packet.dtype).max
    if values.numel() and limit < torch.finfo(values.dtype).max:
        top = float(values.abs().max())
        if top > limit:
            raise WireError(
                f"section {name!r}: value {top:.6g} exceeds {packet.dtype}'s largest value {limit:.6g} "
                "(the decode would overflow)"
            )


def ratio_to_k(ratio: float | None, k: int | None, numel: int, name: str) -> int:
    """Resolve a codec's ``ratio``/``k`` option to the number of kept elements for ``numel``."""
    if numel == 0:
        return 0
    if k is not None:
        if k > numel:
            raise CodecError(f"{name}: k={k} exceeds the tensor's numel={numel}")
        return k
    assert ratio is not None
    return min(numel, max(1, int(-(-ratio * numel // 1))))  # ceil without float surprises


def check_ratio_k(ratio: float | None, k: int | None, name: str) -> None:
    """Validate the mutually exclusive ``ratio`` / ``k`` constructor options."""
    if (ratio is None) == (k is None):
        raise CodecError(f"{name}: give exactly one of ratio or k (got ratio={ratio!r}, k={k!r})")
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise CodecError(f"{name}: k must be an int >= 1, got {k!r}")
    if ratio is not None and not (isinstance(ratio, (int, float)) and 0.0 < ratio <= 1.0):
        raise CodecError(f"{name}: ratio must be in (0, 1], got {ratio!r}")


class Codec(ABC):
    """Base class of all codecs. Subclasses define the class attributes and the hooks below."""

    name: ClassVar[str]
    codec_id: ClassVar[int]
    #: E[decode(encode(x))] == x over the codec's randomness.
    unbiased: ClassVar[bool] = False
    #: The codec draws random numbers from the seed (different seeds -> different output).
    stochastic: ClassVar[bool] = False
    #: :meth:`_decode_into` overwrites ``out`` when not accumulating (so no zero fill first).
    _decode_writes: ClassVar[bool] = False

    # ----- capabilities the collectives choose by (commpress.comm never type-tests codecs) ---
    #: Packets of one tensor encoded with the same seed can be summed value by value (an
    #: all-reduce of :meth:`summable_values`): the cast codecs, and random-k's shared indices.
    summable: ClassVar[bool] = False
    #: A dtype the whole buffer is cast to for a plain all-reduce (fp16/bf16), or None.
    cast_dtype: ClassVar[torch.dtype | None] = None
    #: Every element is represented (a quantizer), so an average can be re-encoded at the same
    #: size: the two-phase all-reduce suits it. Sparse codecs all-gather instead.
    reencodable: ClassVar[bool] = False
    #: Which elements are sent does not depend on their values (random-k): an element waits
    #: about ``1/delta`` steps in the error-feedback residual however large it grows. The DDP
    #: hook then applies SGD momentum as its steady-state gain instead of a velocity
    #: (:meth:`commpress.ddp.optim.MomentumRule.gain`).
    value_blind: ClassVar[bool] = False
    #: Only rounding separates decode(encode(x)) from x (none, fp16, bf16): nothing worth
    #: feeding back, so the adapters run such codecs without an error-feedback memory.
    lossless: ClassVar[bool] = False

    def block_alignment(self) -> int:
        """Elements per scale block: pieces of a tensor cut for a collective keep this alignment."""
        return 1

    def summable_values(self, packet: Packet) -> torch.Tensor:
        """The values an all-reduce sums (codecs with :attr:`summable` only)."""
        raise CodecError(f"codec {self.name!r} has no summable values")

    def packet_from_values(self, values: torch.Tensor, numel: int, dtype: torch.dtype, seed: int) -> Packet:
        """The packet whose :meth:`summable_values` are ``values`` (inverse of that view)."""
        raise CodecError(f"codec {self.name!r} has no summable values")

    # ----- configuration -------------------------------------------------------------------
    @abstractmethod
    def config(self) -> dict[str, Any]:
        """Return the constructor arguments; ``codecs.get(**config)`` rebuilds the codec."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "name")
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and self.config() == other.config()

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.config().items())))

    def delta(self, numel: int) -> float | None:
        """Contraction factor: ``||C(x) - x||^2 <= (1 - delta) ||x||^2`` (None if not contractive).

        For stochastic codecs the bound holds in expectation.
        """
        return None

    # ----- wire description ----------------------------------------------------------------
    def wire_params(self, numel: int) -> tuple[int, int]:
        """The two header parameters this codec writes for a tensor of ``numel`` elements."""
        return (0, 0)

    @classmethod
    def check_wire_params(cls, numel: int, params: tuple[int, int]) -> None:
        """Raise :class:`WireError` when header parameters are invalid for this codec."""
        if params != (0, 0):
            raise WireError(f"params: codec {cls.name!r} takes no parameters, got {params}")

    @classmethod
    @abstractmethod
    def layout(cls, numel: int, dtype: torch.dtype, params: tuple[int, int]) -> list[Section]:
        """Sections (name, dtype, count) of a packet; a pure function of the header."""

    @classmethod
    def check_content(cls, packet: Packet) -> None:
        """Raise :class:`WireError` when decoded sections break the codec's rules."""

    @property
    def fixed_size(self) -> bool:
        """True when all packets for one numel and dtype have the same size.

        False only for variable-length coding options; collectives that exchange fixed-size
        buffers (DDP) need True.
        """
        return True

    def wire_size(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes ``wire.to_bytes(self.encode(x))`` produces for such an ``x``.

        Exact when :attr:`fixed_size`, otherwise the most it can produce.
        """
        check_dtype(dtype)
        return wire.packet_nbytes(self.layout(numel, dtype, self.wire_params(numel)))

    # ----- encode / decode -----------------------------------------------------------------
    def encode(self, x: torch.Tensor, *, seed: int = 0) -> Packet:
        """Compress ``x`` (any shape; flattened in row-major order) into a :class:`Packet`."""
        if not isinstance(x, torch.Tensor):
            raise CodecError(f"x must be a torch.Tensor, got {type(x).__name__}")
        check_dtype(x.dtype)
        rng.check_seed(seed)
        flat = x.reshape(-1).contiguous()  # copies only when x is not contiguous
        params = self.wire_params(flat.numel())
        sections = self._encode(flat, params, seed)
        return Packet(self.name, x.dtype, flat.numel(), params, seed, sections)

    def decode(self, packet: Packet, out: torch.Tensor | None = None, *, accumulate: bool = False) -> torch.Tensor:
        """Reconstruct the tensor; write (or add, with ``accumulate``) into ``out`` if given.

        Without ``out`` the result is 1-D with ``packet.numel`` elements of ``packet.dtype``.
        ``out`` must be contiguous with the same numel, dtype and device as the packet.
        """
        if packet.codec != self.name:
            raise CodecError(f"packet was encoded by codec {packet.codec!r}, not {self.name!r}")
        if out is None:
            if accumulate:
                raise CodecError("accumulate=True needs an out tensor to add into")
            make = torch.empty if self._decode_writes else torch.zeros
            out = make(packet.numel, dtype=packet.dtype, device=packet.device)
            flat = out
            accumulate = not self._decode_writes  # add into the fresh zeros
        else:
            if out.numel() != packet.numel or out.dtype != packet.dtype:
                raise CodecError(
                    f"out has {out.numel()} x {out.dtype}, packet holds {packet.numel} x {packet.dtype}"
                )
            if out.device != packet.device:
                raise CodecError(f"out is on {out.device}, packet on {packet.device}")
            if not out.is_contiguous():
                raise CodecError("out must be contiguous")
            flat = out.view(-1)
        if packet.numel:
            self._decode_into(packet, flat, accumulate)
        return out

    def _decode_into(self, packet: Packet, out: torch.Tensor, accumulate: bool) -> None:
        """Write (or with ``accumulate`` add) the decoded tensor into the 1-D ``out``."""
        if not accumulate:
            out.zero_()
        self._decode_add(packet, out)

    def encode_with_feedback(
        self,
        grad: torch.Tensor,
        residual: torch.Tensor | None = None,
        *,
        seed: int = 0,
        out: torch.Tensor | None = None,
    ) -> tuple[Packet, torch.Tensor] | None:
        """Error-feedback step: encode ``c = grad + residual``; return ``(packet, c - decode)``.

        ``c`` is computed in :func:`compute_dtype` (the residual's dtype, float32 or float64)
        and rounded to ``grad``'s dtype before encoding; ``residual`` (None on the first step)
        has ``grad``'s shape. Returns None, leaving ``residual`` unchanged, when the rounded
        ``c`` holds NaN or Inf (the caller skips the step). Codecs with a fused kernel (sign,
        qsgd) implement :meth:`_encode_fused`, which does all of that in one kernel and updates
        ``residual`` in place (returned as the new residual); the others encode, decode and
        subtract, into ``out`` when given (a reused buffer of ``grad``'s shape in the residual
        dtype, overlapping neither ``grad`` nor ``residual``: saves allocating one per step).
        """
        if not isinstance(grad, torch.Tensor):
            raise CodecError(f"grad must be a torch.Tensor, got {type(grad).__name__}")
        check_dtype(grad.dtype)
        rng.check_seed(seed)
        fused = self._fused_residual(grad, residual) if self.has_fused_feedback else None
        if fused is not None:
            flat = grad.reshape(-1).contiguous()
            params = self.wire_params(flat.numel())
            try:
                sections = self._encode_fused(flat, params, seed, fused.view(-1))
            except NonFiniteError:
                return None
            return Packet(self.name, grad.dtype, flat.numel(), params, seed, sections), fused
        rdt = compute_dtype(grad.dtype)
        if out is not None:
            if out.shape != grad.shape or out.dtype != rdt or out.device != grad.device or not out.is_contiguous():
                raise CodecError(
                    f"out must be a contiguous {rdt} tensor of shape {tuple(grad.shape)} on {grad.device}, "
                    f"got {out.dtype} {tuple(out.shape)} on {out.device}"
                )
            corrected = out.copy_(grad) if residual is None else torch.add(grad, residual, out=out)
        else:
            corrected = grad.to(rdt, copy=True) if residual is None else grad.to(rdt) + residual
        wire_input = corrected.to(grad.dtype)
        if not all_finite(wire_input):
            return None
        packet = self.encode(wire_input, seed=seed)
        self._subtract_decoded(packet, corrected)
        return packet, corrected

    #: Sends a subset of the entries (top-k, random-k): decoding touches only the entries a
    #: ``values`` section carries, and the residual is exactly zero where a value was sent.
    sparse: ClassVar[bool] = False

    def sent_indices(self, packet: Packet) -> torch.Tensor | None:
        """The flat indices ``packet`` carries values for (int64), or None when it covers all of them."""
        return None

    def _subtract_decoded(self, packet: Packet, corrected: torch.Tensor) -> None:
        """``corrected -= decode(packet)`` in ``corrected``'s dtype: the residual update.

        Sparse codecs subtract only the entries they sent (adding the negated values, which is
        the same IEEE operation), instead of decoding a dense, mostly-zero tensor first.
        """
        if not self.sparse:
            corrected.sub_(self.decode(packet).view(corrected.shape).to(corrected.dtype))
            return
        values = packet.sections["values"].neg().to(corrected.dtype)
        negated = dataclasses.replace(packet, sections={**packet.sections, "values": values})
        self._decode_add(negated, corrected.view(-1))

    #: True for codecs that implement :meth:`_encode_fused`.
    has_fused_feedback: ClassVar[bool] = False

    def _encode_fused(
        self, flat: torch.Tensor, params: tuple[int, int], seed: int, residual: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Encode ``flat + residual`` and leave ``c - decode`` in ``residual`` (one kernel).

        Raises :class:`NonFiniteError` without writing anything when ``c`` is not finite.
        """
        raise NotImplementedError

    def _fused_residual(self, grad: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor | None:
        """The flat residual a fused kernel can update in place (zeros on the first step).

        None when ``residual`` has a layout the kernels do not take (the caller then uses the
        default :meth:`encode_with_feedback`).
        """
        rdt = compute_dtype(grad.dtype)
        if residual is None:
            return torch.zeros(grad.shape, dtype=rdt, device=grad.device)
        ok = (
            residual.dtype == rdt
            and residual.device == grad.device
            and residual.shape == grad.shape
            and residual.is_contiguous()
        )
        return residual if ok else None

    @abstractmethod
    def _encode(self, flat: torch.Tensor, params: tuple[int, int], seed: int) -> dict[str, torch.Tensor]:
        """Encode a 1-D tensor of a supported dtype; return the sections in layout order."""

    @abstractmethod
    def _decode_add(self, packet: Packet, out: torch.Tensor) -> None:
        """Add the decoded tensor into the 1-D ``out`` (already zeroed when not accumulating)."""


def check_dtype(dtype: torch.dtype) -> None:
    """Raise :class:`CodecError` unless ``dtype`` is one the codecs accept."""
    if dtype not in FLOAT_DTYPE_CODES:
        names = ", ".join(str(d).removeprefix("torch.") for d in FLOAT_DTYPE_CODES)
        raise CodecError(f"dtype must be one of {names}; got {dtype}")

