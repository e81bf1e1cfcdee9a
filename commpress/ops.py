"""Typed wrappers over the native ``torch.ops.commpress`` kernels, with reference fallbacks.

The extension ``commpress._C`` is optional: it is loaded lazily and defensively, so
``import commpress`` never fails because it is missing (pure-Python install, or a build for
another torch) and never initialises CUDA. Every wrapper picks the native kernel when one is
registered for the tensor's device and falls back to the pure-torch reference otherwise (the
references live with the codecs, in ``commpress/codecs/*.py``, and are the specification);
both produce bit-identical results (tests/test_native.py and tests/test_kernels.py check it).

Errors: bad arguments raise :class:`~commpress.errors.CodecError` naming the argument, from
either path; NaN/Inf in the values to encode raise its subclass :class:`NonFiniteError`, and
then nothing was written (a residual passed for fused error feedback is unchanged).

Set ``COMMPRESS_DISABLE_NATIVE=1`` to force the reference path (used by the tests to check
that the package works without the extension).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any, TypeVar

import torch

from .bitpack import check_bits, pack_bits_reference, packed_nbytes, unpack_bits_reference
from .errors import CodecError

_OPS = (
    "pack_bits",
    "unpack_bits",
    "sign_encode",
    "sign_decode",
    "qsgd_encode",
    "qsgd_decode",
    "topk_select",
    "sparse_scatter_add",
    "randomk_gather",
    "randomk_scatter_add",
)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_R = TypeVar("_R")


class NonFiniteError(CodecError):
    """The values to encode hold NaN or Inf; nothing was encoded and nothing was written."""


@lru_cache(maxsize=1)
def load_native() -> str | None:
    """Load the extension once; return None on success or the reason it is unavailable."""
    if os.environ.get("COMMPRESS_DISABLE_NATIVE", "") not in ("", "0"):
        return "disabled by COMMPRESS_DISABLE_NATIVE"
    try:
        importlib.import_module("commpress._C")  # loading the library registers the ops
    except (ImportError, OSError) as exc:  # missing build, ABI mismatch, missing libs
        return f"{type(exc).__name__}: {exc}"
    _register_fakes()
    return None


def has_native(op: str, device_type: str = "cpu") -> bool:
    """Return True when ``commpress::op`` has a native kernel for ``device_type`` (cpu/cuda)."""
    if load_native() is not None:
        return False
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    if key is None:
        return False
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"commpress::{op}", key))
    except RuntimeError:  # an older build of the extension that lacks this op
        return False


def native_ops() -> dict[str, list[str]]:
    """Map each native op name to the device types it has kernels for (empty when unbuilt)."""
    return {op: [d for d in ("cpu", "cuda") if has_native(op, d)] for op in _OPS}


def cpu_isa(isa: str = "") -> str | None:
    """Instruction-set variant of the native CPU kernels ("default", "avx2", "avx512").

    With ``isa``, switch to it first (CodecError when it is not available on this CPU).
    Returns the active variant, or None without the extension. All variants give identical
    results; this exists for tests and benchmarks.
    """
    if load_native() is not None or not hasattr(torch.ops.commpress, "cpu_isa"):
        return None
    try:
        return str(torch.ops.commpress.cpu_isa(isa))
    except RuntimeError as exc:
        raise CodecError(str(exc).splitlines()[0]) from exc


def cpu_isas() -> list[str]:
    """Instruction-set variants of the native CPU kernels usable on this CPU ([] without them)."""
    if load_native() is not None or not hasattr(torch.ops.commpress, "cpu_isas"):
        return []
    return str(torch.ops.commpress.cpu_isas()).split(",")


def _nblocks(numel: Any, block: Any) -> Any:
    return (numel + block - 1) // block


def _register_fakes() -> None:
    # Shape functions so torch.compile / opcheck can trace the ops without running them.
    def compute(dtype: torch.dtype) -> torch.dtype:
        return torch.float64 if dtype == torch.float64 else torch.float32

    @torch.library.register_fake("commpress::pack_bits")
    def _pack_fake(fields: torch.Tensor, bits: int) -> torch.Tensor:
        return fields.new_empty(packed_nbytes(fields.numel(), bits), dtype=torch.uint8)

    @torch.library.register_fake("commpress::unpack_bits")
    def _unpack_fake(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
        return packed.new_empty(n, dtype=torch.uint8)

    @torch.library.register_fake("commpress::sign_encode")
    def _sign_encode_fake(
        x: torch.Tensor, residual: torch.Tensor | None, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.numel()
        nb = _nblocks(n, block_size) if block_size else (1 if n else 0)
        return x.new_empty(nb, dtype=compute(x.dtype)), x.new_empty((n + 7) // 8, dtype=torch.uint8)

    @torch.library.register_fake("commpress::sign_decode")
    def _sign_decode_fake(
        scales: torch.Tensor, bits: torch.Tensor, block_size: int, out: torch.Tensor, accumulate: bool = True
    ) -> None:
        return None

    @torch.library.register_fake("commpress::qsgd_encode")
    def _qsgd_encode_fake(
        x: torch.Tensor, residual: torch.Tensor | None, bits: int, levels: int, bucket_size: int, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.numel()
        nbytes = (n * bits + 7) // 8
        return x.new_empty(_nblocks(n, bucket_size), dtype=compute(x.dtype)), x.new_empty(nbytes, dtype=torch.uint8)

    @torch.library.register_fake("commpress::qsgd_decode")
    def _qsgd_decode_fake(
        norms: torch.Tensor,
        packed: torch.Tensor,
        bits: int,
        levels: int,
        bucket_size: int,
        out: torch.Tensor,
        accumulate: bool = True,
    ) -> None:
        return None

    @torch.library.register_fake("commpress::topk_select")
    def _topk_fake(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx_dtype = torch.int32 if x.numel() <= (1 << 31) - 1 else torch.int64
        return x.new_empty(k, dtype=idx_dtype), x.new_empty(k)

    @torch.library.register_fake("commpress::sparse_scatter_add")
    def _scatter_fake(indices: list[torch.Tensor], values: list[torch.Tensor], out: torch.Tensor) -> None:
        return None

    @torch.library.register_fake("commpress::randomk_gather")
    def _randomk_gather_fake(x: torch.Tensor, k: int, seed: int, scaled: bool) -> torch.Tensor:
        return x.new_empty(k)

    @torch.library.register_fake("commpress::randomk_scatter_add")
    def _randomk_scatter_fake(values: torch.Tensor, seed: int, out: torch.Tensor) -> None:
        return None


def _native(op: str, fn: Callable[..., _R], *args: Any) -> _R:
    """Call a native op; its TORCH_CHECK failures become CodecError / NonFiniteError."""
    try:
        return fn(*args)
    except RuntimeError as exc:
        message = str(exc).splitlines()[0]
        if not message.startswith(f"{op}:"):
            raise  # not an argument check (e.g. a CUDA error): leave it alone
        if "non-finite input" in message:
            raise NonFiniteError(message) from exc
        raise CodecError(message) from exc


def _signed_seed(seed: int) -> int:
    # the schema's int is int64; uint64 seeds travel as their bit pattern
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 64:
        raise CodecError(f"seed must be an int in [0, 2**64), got {seed!r}")
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _check_vector(name: str, t: torch.Tensor, dtypes: Sequence[torch.dtype] = _FLOAT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise CodecError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or t.dtype not in dtypes:
        raise CodecError(f"{name} must be a 1-D tensor of {'/'.join(str(d) for d in dtypes)}, got {t.dtype} {tuple(t.shape)}")
    if not t.is_contiguous():
        raise CodecError(f"{name} must be contiguous")


def _check_residual(residual: torch.Tensor | None, x: torch.Tensor) -> None:
    if residual is None:
        return
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    _check_vector("residual", residual, (ct,))
    if residual.numel() != x.numel() or residual.device != x.device:
        raise CodecError(
            f"residual has {residual.numel()} elements on {residual.device}, x has {x.numel()} on {x.device}"
        )


# ----- bit packing ------------------------------------------------------------------------------
def pack_bits(fields: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a 1-D uint8 tensor of ``bits``-wide fields LSB-first (see :mod:`commpress.bitpack`)."""
    check_bits(bits)
    if fields.dtype != torch.uint8 or fields.dim() != 1:
        raise CodecError(f"fields must be a 1-D uint8 tensor, got {fields.dtype} {tuple(fields.shape)}")
    if has_native("pack_bits", fields.device.type):
        return _native("pack_bits", torch.ops.commpress.pack_bits.default, fields.contiguous(), bits)
    return pack_bits_reference(fields, bits)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Unpack ``n`` fields of ``bits`` bits from bytes made by :func:`pack_bits`."""
    check_bits(bits)
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise CodecError(f"packed must be a 1-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    if packed.numel() != packed_nbytes(n, bits):
        raise CodecError(
            f"packed holds {packed.numel()} bytes, {n} fields of {bits} bits need {packed_nbytes(n, bits)}"
        )
    if has_native("unpack_bits", packed.device.type):
        return _native("unpack_bits", torch.ops.commpress.unpack_bits.default, packed.contiguous(), bits, n)
    return unpack_bits_reference(packed, bits, n)


# ----- sign ---------------------------------------------------------------------------------------
def sign_encode(
    x: torch.Tensor, block_size: int, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, bits)`` of the sign codec for 1-D ``x``; see :func:`commpress.codecs.sign.encode_reference`.

    With ``residual``: fused error feedback, ``residual`` is updated in place.
    """
    _check_vector("x", x)
    _check_residual(residual, x)
    if has_native("sign_encode", x.device.type):
        return _native("sign_encode", torch.ops.commpress.sign_encode.default, x, residual, block_size)
    from .codecs.sign import encode_reference

    return encode_reference(x, block_size, residual)


def sign_decode(
    scales: torch.Tensor, bits: torch.Tensor, block_size: int, out: torch.Tensor, accumulate: bool = True
) -> None:
    """``out = decode(scales, bits)``, or ``+=`` with ``accumulate``, for sign (1-D contiguous ``out``)."""
    _check_vector("out", out)
    if has_native("sign_decode", out.device.type):
        _native("sign_decode", torch.ops.commpress.sign_decode.default, scales, bits, block_size, out, accumulate)
        return
    from .codecs.sign import decode_reference

    decode_reference(scales, bits, block_size, out, accumulate)


# ----- qsgd ---------------------------------------------------------------------------------------
def qsgd_encode(
    x: torch.Tensor, bits: int, levels: int, bucket_size: int, seed: int, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norms, packed)`` of QSGD for 1-D ``x``; see :func:`commpress.codecs.qsgd.encode_reference`.

    With ``residual``: fused error feedback, ``residual`` is updated in place.
    """
    _check_vector("x", x)
    _check_residual(residual, x)
    signed = _signed_seed(seed)
    if has_native("qsgd_encode", x.device.type):
        return _native(
            "qsgd_encode", torch.ops.commpress.qsgd_encode.default, x, residual, bits, levels, bucket_size, signed
        )
    from .codecs.qsgd import encode_reference

    return encode_reference(x, bits, levels, bucket_size, seed, residual)


def qsgd_decode(
    norms: torch.Tensor,
    packed: torch.Tensor,
    bits: int,
    levels: int,
    bucket_size: int,
    out: torch.Tensor,
    accumulate: bool = True,
) -> None:
    """``out = decode(norms, packed)``, or ``+=`` with ``accumulate``, for QSGD (1-D contiguous ``out``)."""
    _check_vector("out", out)
    if has_native("qsgd_decode", out.device.type):
        op = torch.ops.commpress.qsgd_decode.default
        _native("qsgd_decode", op, norms, packed, bits, levels, bucket_size, out, accumulate)
        return
    from .codecs.qsgd import decode_reference

    decode_reference(norms, packed, bits, levels, bucket_size, out, accumulate)


# ----- top-k --------------------------------------------------------------------------------------
def topk_select(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, values)`` of the k largest ``|x|``, exact, indices ascending; see the reference."""
    _check_vector("x", x)
    if has_native("topk_select", x.device.type):
        return _native("topk_select", torch.ops.commpress.topk_select.default, x, k)
    from .codecs.topk import select_reference

    return select_reference(x, k)


def sparse_scatter_add(indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """``out[indices[p]] += values[p]`` for every payload p, in order (bounds/duplicate-checked)."""
    _check_vector("out", out)
    indices, values = list(indices), list(values)
    if has_native("sparse_scatter_add", out.device.type):
        _native("sparse_scatter_add", torch.ops.commpress.sparse_scatter_add.default, indices, values, out)
        return
    from .codecs.topk import scatter_add_reference

    scatter_add_reference(indices, values, out)


# ----- random-k -----------------------------------------------------------------------------------
def randomk_gather(x: torch.Tensor, k: int, seed: int, scaled: bool) -> torch.Tensor:
    """The k values random-k sends for 1-D ``x``; see :func:`commpress.codecs.randomk.gather_reference`."""
    _check_vector("x", x)
    signed = _signed_seed(seed)
    if has_native("randomk_gather", x.device.type):
        return _native("randomk_gather", torch.ops.commpress.randomk_gather.default, x, k, signed, scaled)
    from .codecs.randomk import gather_reference

    return gather_reference(x, k, seed, scaled)


def randomk_scatter_add(values: torch.Tensor, seed: int, out: torch.Tensor) -> None:
    """``out[idx] += values`` at the seed's random-k indices (1-D contiguous ``out``)."""
    _check_vector("out", out)
    signed = _signed_seed(seed)
    if has_native("randomk_scatter_add", out.device.type):
        _native("randomk_scatter_add", torch.ops.commpress.randomk_scatter_add.default, values.contiguous(), signed, out)
        return
    from .codecs.randomk import scatter_add_reference

    scatter_add_reference(values, seed, out)
