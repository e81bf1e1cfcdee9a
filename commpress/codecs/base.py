"""The codec interface: encode/decode, exact wire size and stated properties.

A codec is a pure function of its input and a seed. Its pure-torch implementation is the
specification of what the native kernels must compute; the properties it states
(``unbiased``, contraction ``delta``) are checked by hypothesis tests in tests/.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from .. import rng, wire
from ..errors import CodecError, WireError
from ..packet import FLOAT_DTYPE_CODES, Packet, Section


def index_dtype(numel: int) -> torch.dtype:
    """Dtype of index sections: int32 while every index fits, else int64."""
    return torch.int32 if numel <= (1 << 31) - 1 else torch.int64


def scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of per-block scales/norms: float64 for float64 input, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic dtype of the codecs' math: float64 for float64 input, float32 otherwise."""
    return scale_dtype(dtype)


def require_finite(x: torch.Tensor, what: str = "x") -> None:
    """Raise :class:`CodecError` if ``x`` holds NaN or Inf."""
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise CodecError(f"{what} contains NaN or Inf; commpress does not encode non-finite values")


def check_finite_section(packet: Packet, name: str) -> None:
    """Wire check: a value section must hold only finite numbers (encoders never send others)."""
    values = packet.sections[name]
    if values.numel() and not bool(torch.isfinite(values).all()):
        raise WireError(f"section {name!r}: contains NaN or Inf")


def check_scales(packet: Packet, name: str) -> None:
    """Wire check shared by scaled codecs: a scale section must be finite and >= 0."""
    scales = packet.sections[name]
    if scales.numel() and not bool((torch.isfinite(scales) & (scales >= 0)).all()):
        raise WireError(f"section {name!r}: scales must be finite and >= 0")


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

    def wire_size(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Exact number of bytes ``wire.to_bytes(self.encode(x))`` produces for such an ``x``."""
        check_dtype(dtype)
        return wire.packet_nbytes(self.layout(numel, dtype, self.wire_params(numel)))

    # ----- encode / decode -----------------------------------------------------------------
    def encode(self, x: torch.Tensor, *, seed: int = 0) -> Packet:
        """Compress ``x`` (any shape; flattened in row-major order) into a :class:`Packet`."""
        if not isinstance(x, torch.Tensor):
            raise CodecError(f"x must be a torch.Tensor, got {type(x).__name__}")
        check_dtype(x.dtype)
        rng.check_seed(seed)
        flat = x.reshape(-1)  # copies only when x is not contiguous
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
            out = torch.zeros(packet.numel, dtype=packet.dtype, device=packet.device)
            flat = out
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
            if not accumulate:
                flat.zero_()
        if packet.numel:
            self._decode_add(packet, flat)
        return out

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

