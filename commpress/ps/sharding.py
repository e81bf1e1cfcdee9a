"""Flatten a model's parameters and split them into shards balanced by bytes.

The parameters, in ``named_parameters()`` order, form one flat vector of ``numel`` elements.
Shard ``s`` of ``S`` holds the contiguous range ``[numel*s//S, numel*(s+1)//S)``, so shards
differ by at most one element (one element size in bytes); a parameter may straddle two
shards. Inside a shard:

* **pieces** are the intersections of parameters with the shard: the server's optimizer
  sees one tensor per piece (the parameter's own shape when the piece is the whole
  parameter, 1-D otherwise), so per-parameter optimizer state keeps its meaning;
* **segments** are the units a codec encodes: each piece that the shared selection rule
  (:class:`commpress.selection.SelectionRule`, the one DDP uses, with ``min_numel =
  min_compress``) picks, judged by its parameter's shape and the piece's own element count, is
  compressed on its own (one scale per tensor, as the design notes ask), and runs of the
  other pieces (biases, norms, tiny tensors) are merged into one dense segment sent as ``none``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..selection import SelectionRule
from .errors import ConfigError


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: its name, shape and position in the flat vector."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        """Element count of the parameter."""
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Piece:
    """The part ``[start, stop)`` (flat, global) of parameter ``param`` that lies in one shard."""

    param: int
    name: str
    start: int
    stop: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Element count of the piece."""
        return self.stop - self.start


@dataclass(frozen=True)
class Segment:
    """A codec unit: flat range ``[start, stop)`` encoded as one packet (``compress`` or dense)."""

    start: int
    stop: int
    compress: bool

    @property
    def numel(self) -> int:
        """Element count of the segment."""
        return self.stop - self.start


@dataclass(frozen=True)
class Shard:
    """Flat range ``[start, stop)`` held by server ``index``, with its pieces and segments."""

    index: int
    start: int
    stop: int
    pieces: tuple[Piece, ...]
    segments: tuple[Segment, ...]

    @property
    def numel(self) -> int:
        """Element count of the shard."""
        return self.stop - self.start

    def local(self, seg: Segment | Piece) -> slice:
        """Slice of ``seg`` inside a tensor that holds only this shard."""
        return slice(seg.start - self.start, seg.stop - self.start)


class Layout:
    """Parameter layout shared by every rank: flat order, dtype and the shard split.

    Args:
        params: ``(name, shape)`` in the model's ``named_parameters()`` order.
        dtype: the parameters' dtype (all parameters must share it).
        servers: number of shards.
        min_compress: smallest piece of a >= 2-D parameter that is compressed.
    """

    def __init__(
        self,
        params: Sequence[tuple[str, Sequence[int]]],
        dtype: torch.dtype,
        servers: int,
        min_compress: int = 512,
    ) -> None:
        if servers < 1:
            raise ConfigError(f"servers must be >= 1, got {servers}")
        if min_compress < 1:
            raise ConfigError(f"min_compress must be >= 1, got {min_compress}")
        if dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            raise ConfigError(f"parameters must be floating point, got {dtype}")
        specs: list[ParamSpec] = []
        offset = 0
        for name, shape in params:
            spec = ParamSpec(str(name), tuple(int(d) for d in shape), offset)
            specs.append(spec)
            offset += spec.numel
        self.params = tuple(specs)
        self.dtype = dtype
        self.numel = offset
        self.servers = servers
        self.min_compress = min_compress
        self.rule = SelectionRule(min_numel=min_compress)
        if self.numel < servers:
            raise ConfigError(f"the model has {self.numel} elements, fewer than the {servers} shards")
        self.shards = tuple(self._shard(s) for s in range(servers))

    @classmethod
    def from_model(cls, model: torch.nn.Module, servers: int, min_compress: int = 512) -> Layout:
        """Layout of ``model``'s trainable parameters."""
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigError("the model has no trainable parameters")
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) != 1:
            raise ConfigError(f"all parameters must share one dtype, got {sorted(map(str, dtypes))}")
        return cls([(n, tuple(p.shape)) for n, p in named], dtypes.pop(), servers, min_compress)

    def _shard(self, s: int) -> Shard:
        lo, hi = self.numel * s // self.servers, self.numel * (s + 1) // self.servers
        pieces: list[Piece] = []
        for i, p in enumerate(self.params):
            a, b = max(lo, p.offset), min(hi, p.offset + p.numel)
            if a < b:
                whole = a == p.offset and b == p.offset + p.numel
                pieces.append(Piece(i, p.name, a, b, p.shape if whole else (b - a,)))
        segments: list[Segment] = []
        for piece in pieces:
            compress = self.rule(piece.name, self.params[piece.param].shape, piece.numel)
            last = segments[-1] if segments else None
            if not compress and last is not None and not last.compress and last.stop == piece.start:
                segments[-1] = Segment(last.start, piece.stop, False)
            else:
                segments.append(Segment(piece.start, piece.stop, compress))
        return Shard(s, lo, hi, tuple(pieces), tuple(segments))

    # ----- flat views ----------------------------------------------------------------------
    def check_model(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        """Return ``model``'s trainable parameters after checking they match this layout."""
        params = [p for _, p in model.named_parameters() if p.requires_grad]
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        want = [(p.name, p.shape) for p in self.params]
        got = [(n, tuple(p.shape)) for n, p in zip(names, params)]
        if got != want:
            raise ConfigError(f"model parameters {got[:4]}... do not match the layout {want[:4]}...")
        return params

    def flatten(self, tensors: Iterable[torch.Tensor]) -> torch.Tensor:
        """Concatenate tensors (parameters or gradients) in layout order into one flat tensor."""
        return torch.cat([t.detach().reshape(-1) for t in tensors]).to(self.dtype)

    def bind(self, model: torch.nn.Module, flat: torch.Tensor) -> None:
        """Make ``model``'s parameters views into ``flat`` (copying its current values in)."""
        for spec, p in zip(self.params, self.check_model(model)):
            view = flat[spec.offset : spec.offset + spec.numel].view(spec.shape)
            view.copy_(p.detach())
            p.data = view

    def load(self, model: torch.nn.Module, flat: torch.Tensor) -> None:
        """Copy the flat vector ``flat`` into ``model``'s parameters."""
        if flat.numel() != self.numel:
            raise ConfigError(f"flat vector has {flat.numel()} elements, layout needs {self.numel}")
        with torch.no_grad():
            for spec, p in zip(self.params, self.check_model(model)):
                p.copy_(flat[spec.offset : spec.offset + spec.numel].view(spec.shape))

    def describe(self) -> dict[str, Any]:
        """Plain-data description (fingerprinted, and printed by the CLI)."""
        return {
            "params": [[p.name, list(p.shape)] for p in self.params],
            "dtype": str(self.dtype).removeprefix("torch."),
            "servers": self.servers,
            "min_compress": self.min_compress,
        }


def fingerprint(*parts: Any) -> int:
    """A 64-bit hash of JSON-serialisable parts: ranks compare it to detect mismatched setups."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little")
