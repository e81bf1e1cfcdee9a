"""How the FSDP reduce-scatter keeps its error-feedback residuals between steps (``residual_dtype``).

A rank compresses the ``n-1`` chunks of the flat gradient it sends, so its residuals cover
``(n-1)/n`` of the unsharded gradient, ``(n-1) * b`` bytes per shard element at ``b`` bytes per
residual element, against ``4`` bytes per element of its float32 gradient shard. The residual
must stay with the sender (the error is made by the sender's encoder; the owner only sees the
decode, so an owner-side "residual" after the reduction is not error feedback), so holding the
residuals to one shard means storing them in fewer bits as the world grows:

============  ==========================  ===================================
kind          bytes per residual element   fits one fp32 shard up to
============  ==========================  ===================================
float32       4                            2 ranks
bfloat16      2                            3 ranks
int8          1 + 4/64 (a scale / block)   4 ranks
int4          0.5 + 4/64                   8 ranks
ternary       0.2 + 4/64 (5 per byte)      16 ranks
============  ==========================  ===================================

``residual_dtype="auto"`` takes the widest kind that fits at the world size (:func:`auto_kind`).
``int8`` / ``int4`` / ``ternary`` (levels -1, 0, 1: :mod:`commpress.spec.ternary`) quantize each block of :data:`BLOCK` elements to its absolute maximum with
*stochastic* rounding (seeded per step, parameter and chunk, so a resumed run is bit-exact):
``E[stored] = residual``, so what a step's rounding loses is unbiased noise that later steps
send, never a bias that drops small coordinates for good (nearest rounding would zero every
element below ``max/254`` of its block at every step). Between steps only the stored form
exists; the float32 working copy lives for one module's reduce-scatter.

**Velocities** (top-k / sign with SGD momentum, DGC; Adam/AdamW, 1-bit Adam) are the second buffer:
each rank's *local* velocity of the compressed parameters covers the full local gradient, ``n``
chunks, ``n * b_v`` bytes per shard element. They are stored by the same :class:`ResidualStore`
(the same blockwise quantiser and stochastic rounding), and the budget of both together is one
float32 gradient shard, ``4`` bytes per shard element (``4/n`` bytes per parameter)::

    (n-1) * b_r + n * b_v <= 4

Velocities are quantised in blocks of :data:`VELOCITY_BLOCK` (64: one scale per 64 elements,
``b_v`` = 1.0625 for int8, 0.5625 for int4; int4 velocities in blocks of 256 cost accuracy), and
residuals in blocks of :data:`BLOCK` (64 too, since 2026-12-04).
:func:`auto_kinds` takes the first pair of :data:`PAIRS` that fits: int8/int8 at 2 ranks
(3.19 of 4), int8/int4 at 3 (3.81), int4/int4 at 4 (3.94), ternary/int4 at 5 (3.86). From 6
ranks only ternary velocities fit, and top-k's SGD momentum loses accuracy in them
(:data:`PAIRS`): Adam (and sign with SGD momentum) take ternary/ternary up to 8 ranks
(``15 * 0.2625 = 3.94``); top-k with SGD momentum warns and keeps ternary/int4 (1.58 shards at 8).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ..checks import check_loaded_tensor
from ..errors import CodecError
from ..kernels import blockint
from ..kernels import ternary as ternary_kernel
from ..spec import ternary

logger = logging.getLogger("commpress")

#: Elements per quantization block of a residual (one float32 scale each). 64 since 2026-12-04: int4
#: residuals in blocks of 256 cost top-k 1% + SGD momentum about a point of held-out loss at 4 ranks
#: (byte LM, seeds 0 / 1: +3.85% / +1.72% over fp32 against float32's +2.73% / +0.82%; blocks of 64
#: +3.10% / +0.98%), and with 64 every pair :func:`auto_kinds` picked still fits (int4 residuals
#: alone up to 8 ranks, 3.94 of 4 bytes).
BLOCK = 64
#: The residual block before 2026-12-04: such checkpoints' residuals are decoded and stored again in :data:`BLOCK`.
LEGACY_BLOCK = 256
#: Elements per quantization block of a local velocity: int4 velocities in blocks of 256 cost top-k
#: 1% + AdamW 14 points at 4 ranks (digits, seed 0: 81.4% vs float32's 95.5%; float32 residuals with
#: int4 velocities 89.7%, int4 residuals with float32 velocities 95.2%); blocks of 64 94.2%, and
#: 64 is the smallest power of two with which int4 + int4 still fits one shard at 4 ranks (3.94 of 4 with residuals in blocks of 64).
VELOCITY_BLOCK = 64

#: The kinds on offer, by name (``residual_dtype`` also takes ``torch.float32`` / ``torch.bfloat16``).
KINDS = ("float32", "bfloat16", "int8", "int4", "ternary")
_BITS = {"int8": 8, "int4": 4}
#: The kinds stored as codes and one float32 scale per block.
QUANTIZED = ("int8", "int4", "ternary")
#: The dtype each kind's codes are stored in (int4: two codes per uint8; ternary: five per uint8).
CODE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8, "int4": torch.uint8,
               "ternary": torch.uint8}


def resolve_kind(value: Any) -> str:
    """``residual_dtype`` -> a kind name or ``"auto"`` (:class:`CodecError` for anything else)."""
    if value is torch.float32 or value is torch.bfloat16:
        return str(value).removeprefix("torch.")
    if isinstance(value, str) and (value in KINDS or value == "auto"):
        return value
    raise CodecError(
        "residual_dtype must be torch.float32, torch.bfloat16, 'int8', 'int4', 'ternary' or 'auto' "
        f"(the widest that keeps the residuals within one gradient shard), got {value!r}"
    )


def bytes_per_element(kind: str, block: int = BLOCK) -> float:
    """Stored bytes per element (block scales included; ``block``: elements per scale)."""
    return {"float32": 4.0, "bfloat16": 2.0, "int8": 1.0 + 4.0 / block, "int4": 0.5 + 4.0 / block,
            "ternary": 1.0 / ternary.PER_BYTE + 4.0 / block}[kind]


def auto_kind(world_size: int, grad_bytes: int = 4) -> str:
    """The widest kind whose ``(n-1)`` residual chunks fit in one shard of ``grad_bytes`` per element (ternary: up to 16 ranks)."""
    for kind in KINDS:
        if (world_size - 1) * bytes_per_element(kind) <= grad_bytes:
            return kind
    logger.warning("commpress: at %d ranks even ternary residuals exceed one gradient shard (%.2fx)",
                   world_size, (world_size - 1) * bytes_per_element("ternary") / grad_bytes)
    return "ternary"


#: (residual kind, velocity kind) in order of preference for :func:`auto_kinds` with local velocities.
#: Ternary velocities only where measured harmless (``ternary_velocities``: Adam's compressed momentum,
#: and sign's SGD momentum): at 8 ranks (digits MLP, seeds 0 / 1) AdamW's stored ternary lost nothing
#: (top-k 1%: 96.7 / 97.0% against float32's 95.5 / 97.0%), nor did sign + SGD momentum's (97.7 / 97.2 /
#: 97.7%, seeds 0-2, float32 96.7 / 97.2 / 97.0%), while top-k's DGC velocity collapsed (59.9 / 84.4%
#: against 97.2 / 96.5%: top-k picks the rounding noise the residual accumulates); ternary residuals
#: under int4 velocities kept top-k + SGD at 98.2 / 96.7%.
PAIRS = (("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "int8"), ("int8", "int8"),
         ("bfloat16", "int4"), ("int8", "int4"), ("int4", "int4"), ("ternary", "int4"), ("ternary", "ternary"))


def state_bytes(world_size: int, residual: str, velocity: str | None, velocity_chunks: int | None = None) -> float:
    """Stored bytes per gradient-shard element: ``(n-1)`` residual chunks plus ``n`` local velocity chunks.

    ``velocity=None``: no local velocities (the residuals alone). One float32 shard is 4.
    ``velocity_chunks``: local velocity chunks when not ``n`` (FSDP sharded inside a node: 1
    residual and 1 velocity chunk, passed as ``world_size=2, velocity_chunks=1``).
    """
    out = (world_size - 1) * bytes_per_element(residual)
    chunks = world_size if velocity_chunks is None else velocity_chunks
    return out + (0.0 if velocity is None else chunks * bytes_per_element(velocity, VELOCITY_BLOCK))


def velocity_kind_beside(residual: str, world_size: int, velocity_chunks: int | None = None,
                         ternary_velocities: bool = False, grad_bytes: int = 4) -> str:
    """The velocity kind of :func:`auto_kinds` when the residual kind is already fixed (an optimizer found late).

    The velocity of the first :data:`PAIRS` entry with this residual kind that fits one shard,
    else the widest velocity kind that fits beside it, else the narrowest allowed one with a
    warning (float32 residuals at 2 ranks leave no room).
    """
    allowed = [v for v in ("float32", "bfloat16", "int8", "int4", "ternary") if ternary_velocities or v != "ternary"]
    paired = [v for r, v in PAIRS if r == residual and v in allowed]
    for velocity in [*paired, *allowed]:
        if state_bytes(world_size, residual, velocity, velocity_chunks) <= grad_bytes:
            return velocity
    logger.warning("commpress: at %d ranks %s residuals and %s local velocities take %.2f gradient shards (the "
                   "residual kind was sized before the optimizer was found; pass optimizer= to register to size both)",
                   world_size, residual, allowed[-1],
                   state_bytes(world_size, residual, allowed[-1], velocity_chunks) / grad_bytes)
    return allowed[-1]


def auto_kinds(world_size: int, local_velocity: bool, grad_bytes: int = 4,
               velocity_chunks: int | None = None, ternary_velocities: bool = False,
               warn: bool = True) -> tuple[str, str]:
    """``(residual kind, velocity kind)`` of ``residual_dtype="auto"``: the first that fits one gradient shard.

    Without local velocities the residual kind is :func:`auto_kind`'s (velocities, shard-sized
    where any, stay float32). With them, the first of :data:`PAIRS` for which
    :func:`state_bytes` is at most ``grad_bytes``; ternary velocities only with
    ``ternary_velocities`` (Adam's compressed momentum, sign's SGD momentum; top-k's SGD velocity
    loses accuracy in them). So top-k with SGD momentum fits up to 5 ranks (ternary/int4 there),
    the others up to 8 (ternary/ternary: 3.94 of 4). Beyond: a warning (unless ``warn`` is False)
    and the smallest allowed pair.
    """
    if not local_velocity:
        return auto_kind(world_size, grad_bytes), "float32"
    allowed = [p for p in PAIRS if ternary_velocities or p[1] != "ternary"]
    for residual, velocity in allowed:
        if state_bytes(world_size, residual, velocity, velocity_chunks) <= grad_bytes:
            return residual, velocity
    residual, velocity = allowed[-1]
    if warn:
        logger.warning("commpress: at %d ranks %s residuals and %s local velocities take %.2f gradient shards "
                       "(no stored kind fits both in one without losing accuracy); codec='qsgd' keeps no state, "
                       "and residual_dtype='ternary' fits up to 8 ranks (SGD momentum with top-k loses accuracy "
                       "there: docs/fsdp.md#memory)", world_size, residual, velocity,
                       state_bytes(world_size, residual, velocity, velocity_chunks) / grad_bytes)
    return residual, velocity


def quantize(e: torch.Tensor, bits: int, seed: int, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax quantization with stochastic rounding: ``(codes, scales)``.

    The rounding is :func:`commpress.spec.blockint.encode_stochastic_reference`'s (24-bit
    counter-based uniforms of ``seed``, so a resumed run draws the same), run by the native
    ``blockint_encode_sr`` kernel where built (about 10x the vectorised torch it replaced).
    ``codes``: int8 levels ``q`` in ``[-L, L]`` (``L = 2**(bits-1) - 1``), or for ``bits=4``
    ``q + 8`` two per uint8 (the first in the low nibble), padded with ``q = 0`` to whole blocks;
    ``scales``: float32, one per block of ``block`` (even) elements. ``seed`` in [0, 2**64).
    """
    x = e.reshape(-1)
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.to(torch.float32).contiguous()
    n = x.numel()
    padded = -(-n // block) * block
    scales, fields = blockint.encode_stochastic(x, bits, block, seed)
    if bits == 8:
        codes = fields.sub_(127).view(torch.int8)  # field q + 127 -> q (uint8 arithmetic wraps)
        if padded != n:
            codes = torch.cat((codes, codes.new_zeros(padded - n)))
        return codes, scales
    fields.add_(0x11)  # each nibble q + 7 -> q + 8 (at most 15: no carry)
    if n % 2:
        fields[-1] = (fields[-1] & 0x0F) | 0x80  # the unused high nibble: q = 0
    if padded != n:
        fields = torch.cat((fields, fields.new_full(((padded - n) // 2,), 0x88)))
    return fields, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int, numel: int, block: int = BLOCK) -> torch.Tensor:
    """Inverse of :func:`quantize`: a float32 tensor of ``numel`` elements (``blockint_decode``)."""
    if bits == 8:
        fields = codes[:numel].view(torch.uint8).add(127)  # q -> q + 127 (wraps: -127 is 0)
    else:
        fields = codes[: (numel + 1) // 2].sub(0x11)  # nibbles q + 8 -> q + 7 (valid codes are >= 1: no borrow)
    out = torch.empty(numel, dtype=torch.float32, device=codes.device)
    blockint.decode(scales, fields, bits, block, out)
    return out


def check_codes(kind: str, codes: torch.Tensor, name: str) -> None:
    """ValueError when int8 / int4 ``codes`` hold a level outside ``[-L, L]`` (-128; a zero nibble), which no store writes."""
    if kind == "ternary":
        if bool((codes > ternary.MAX_BYTE).any()):
            raise ValueError(f"{name} holds a ternary byte outside [0, {ternary.MAX_BYTE}] (corrupt codes)")
        return
    if kind == "int8":
        bad = bool((codes == -128).any())
    elif kind == "int4":
        bad = bool(((codes & 0x0F) == 0).any() or ((codes >> 4) == 0).any())
    else:
        return
    if bad:
        raise ValueError(f"{name} holds a {kind} code outside [-{(1 << (_BITS[kind] - 1)) - 1}, "
                         f"{(1 << (_BITS[kind] - 1)) - 1}] (corrupt codes)")


def stored_shapes(kind: str, numel: int, block: int = BLOCK) -> dict[str, tuple[int]]:
    """Shapes of the stored tensors of one entry of ``numel`` elements (``codes`` and ``scales``)."""
    blocks = -(-numel // block)
    if kind == "ternary":
        return {"codes": (ternary.packed_nbytes(blocks * block),), "scales": (blocks,)}
    if kind in _BITS:
        return {"codes": (blocks * block * _BITS[kind] // 8,), "scales": (blocks,)}
    return {"codes": (numel,)}


def decoded(kind: Any, codes: Mapping[str, Any], scales: Mapping[str, Any], block: int,
            what: str = "residual") -> dict[str, torch.Tensor]:
    """Stored entries of ``kind`` (:meth:`ResidualStore.state` output of any world size) as float32 tensors.

    For what a load at another world size drops (its warning's norms): each entry's length is
    read from its own codes, not from this rank's layout. ValueError for an entry that is not a
    1-D tensor of the kind's dtype, or int8/int4 codes whose scales do not match them.
    """
    if kind not in KINDS:
        raise ValueError(f"{what}s are stored as {kind!r}, not one of {KINDS}")
    dtype = CODE_DTYPES[kind]
    out = {}
    for key, value in codes.items():
        if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.dtype != dtype:
            raise ValueError(f"{what} {key!r} must be a 1-D {dtype} tensor ({kind})")
        if kind not in QUANTIZED:
            out[key] = value.float()
            continue
        s = scales.get(key)
        if kind == "ternary":
            if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.dim() != 1 \
                    or value.numel() != ternary.packed_nbytes(s.numel() * block):
                raise ValueError(f"{what} {key!r}: scales must be a float32 tensor of one scale per {block} levels")
            check_codes(kind, value, f"{what} {key!r}")
            out[key] = ternary_kernel.decode(s, value, block, s.numel() * block)
            continue
        numel = value.numel() * 8 // _BITS[kind]
        if block == BLOCK and what == "residual" and isinstance(s, torch.Tensor) and _legacy(kind, numel, value, s):
            block = LEGACY_BLOCK  # written before 2026-12-04
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or tuple(s.shape) != (-(-numel // block),) \
                or numel % block:
            raise ValueError(f"{what} {key!r}: scales must be a float32 tensor of one scale per {block} codes")
        check_codes(kind, value, f"{what} {key!r}")
        out[key] = dequantize(value, s, _BITS[kind], numel, block)
    return out


def _legacy(kind: str, numel: int, codes: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether ``codes`` / ``scales`` of a ``numel``-element entry are laid out in :data:`LEGACY_BLOCK` (not :data:`BLOCK`)."""
    def shapes(block: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        s = stored_shapes(kind, numel, block)
        return s["codes"], s["scales"]
    found = (tuple(codes.shape), tuple(scales.shape))
    return found == shapes(LEGACY_BLOCK) and found != shapes(BLOCK)


class ResidualStore:
    """Residuals or local velocities between steps in their stored kind (bfloat16, int8, int4 or ternary).

    float32 is not stored here (the adapter keeps those tensors as they are). ``what`` names the
    entries in load errors (``"residual"``, ``"velocity"``); ``block``: elements per int8/int4 scale.
    """

    __slots__ = ("kind", "codes", "scales", "numels", "what", "block")

    def __init__(self, kind: str, what: str = "residual", block: int = BLOCK) -> None:
        self.kind = kind
        self.what = what
        self.block = block
        self.codes: dict[str, torch.Tensor] = {}
        self.scales: dict[str, torch.Tensor] = {}
        self.numels: dict[str, int] = {}

    def put(self, key: str, e: torch.Tensor, seed: int) -> None:
        """Store the float32 tensor ``e`` of ``key`` (bfloat16: rounded to nearest, in place)."""
        if self.kind == "bfloat16":
            low = self.codes.get(key)
            if low is None:
                self.codes[key] = e.to(torch.bfloat16)
            else:
                low.copy_(e)
        elif self.kind == "ternary":
            self.scales[key], self.codes[key] = ternary_kernel.encode_stochastic(e, self.block, seed)
        else:
            self.codes[key], self.scales[key] = quantize(e, _BITS[self.kind], seed, self.block)
        self.numels[key] = e.numel()

    def get(self, key: str) -> torch.Tensor | None:
        """The float32 working copy of ``key``'s entry (None when none is stored)."""
        codes = self.codes.get(key)
        if codes is None:
            return None
        if self.kind == "bfloat16":
            return codes.float()
        if self.kind == "ternary":
            return ternary_kernel.decode(self.scales[key], codes, self.block, self.numels[key])
        return dequantize(codes, self.scales[key], _BITS[self.kind], self.numels[key], self.block)

    def drop(self, key: str) -> None:
        """Forget ``key``'s entry (a residual flushed into a dense step)."""
        self.codes.pop(key, None)
        self.scales.pop(key, None)
        self.numels.pop(key, None)

    def nbytes(self) -> int:
        """Bytes held between steps."""
        return sum(t.numel() * t.element_size() for d in (self.codes, self.scales) for t in d.values())

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Copies of the stored codes and scales (checkpoint form)."""
        return ({k: v.detach().clone() for k, v in self.codes.items()},
                {k: v.detach().clone() for k, v in self.scales.items()})

    def load(self, codes: Mapping[str, Any], scales: Mapping[str, Any], numels: Mapping[str, int]) -> None:
        """Validate and adopt :meth:`state` output (``numels``: the entries this rank keeps); all or nothing.

        Residuals written in blocks of :data:`LEGACY_BLOCK` (before 2026-12-04) are decoded and
        stored again in :data:`BLOCK` (stochastic rounding seeded by the entry's position, so
        every load of that file gives the same state; the run resumes, not bit for bit).
        """
        what = self.what
        dtype = CODE_DTYPES[self.kind]
        new_codes, new_scales = {}, {}
        legacy = {}
        for key, value in codes.items():
            if key not in numels:
                raise ValueError(f"{what} {key!r} is not one this rank keeps")
            block = self.block
            s = scales.get(key)
            if (self.kind in _BITS and what == "residual" and block == BLOCK and isinstance(value, torch.Tensor)
                    and isinstance(s, torch.Tensor) and _legacy(self.kind, numels[key], value, s)):
                block = LEGACY_BLOCK
            shapes = stored_shapes(self.kind, numels[key], block)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != shapes["codes"]:
                raise ValueError(f"{what} {key!r} must be a tensor of shape {shapes['codes']} ({self.kind} codes)")
            if self.kind == "bfloat16":
                check_loaded_tensor(value, f"{what} {key!r}", dtypes=(dtype,))
            elif value.dtype != dtype:
                raise ValueError(f"{what} {key!r} has dtype {value.dtype}, expected {dtype} ({self.kind} codes)")
            check_codes(self.kind, value, f"{what} {key!r}")
            new_codes[key] = value.detach().clone()
            if self.kind in QUANTIZED:
                s = scales.get(key)
                if not isinstance(s, torch.Tensor) or tuple(s.shape) != shapes["scales"]:
                    raise ValueError(f"{what} {key!r}: scales must be a tensor of shape {shapes['scales']}")
                check_loaded_tensor(s, f"{what} {key!r} scales", dtypes=(torch.float32,))
                new_scales[key] = s.detach().clone()
                if block != self.block:
                    legacy[key] = block
        if set(scales) - set(codes):
            raise ValueError(f"{what} scales without codes: {sorted(set(scales) - set(codes))}")
        for i, (key, block) in enumerate(sorted(legacy.items())):
            e = dequantize(new_codes[key], new_scales[key], _BITS[self.kind], numels[key], block)
            new_codes[key], new_scales[key] = quantize(e, _BITS[self.kind], i, self.block)
        if legacy:
            logger.warning("commpress: %d %s(s) stored in blocks of %d (a checkpoint written before 2026-12-04) "
                           "were stored again in blocks of %d", len(legacy), what, LEGACY_BLOCK, self.block)
        self.codes, self.scales = new_codes, new_scales
        self.numels = {k: numels[k] for k in new_codes}


__all__ = ["BLOCK", "CODE_DTYPES", "KINDS", "PAIRS", "QUANTIZED", "VELOCITY_BLOCK", "ResidualStore", "auto_kind", "auto_kinds", "bytes_per_element", "check_codes", "decoded",
           "dequantize", "quantize", "resolve_kind", "state_bytes", "stored_shapes"]
