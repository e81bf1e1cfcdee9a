"""The kernel contract: one argument check per op, run once before any backend.

:func:`commpress.kernels.ops` calls ``CHECKS[op](a)`` (``a`` the op's argument record of
:mod:`.schema`, the native schema's arguments) before it picks a backend, so native, numba, CuPy and the
reference all see only arguments that passed this one statement of the contract. The Python
backends check nothing themselves (numba and CuPy kernels do no bounds checking: they are reached
only through :mod:`.ops`); the native ops keep just the checks that protect memory when
``torch.ops.commpress.*`` is called directly (``csrc/checks.h``), worded as they like.

Every failure raises :class:`~commpress.errors.KernelArgumentError` ``"<op>: <argument> ..."``.
Failures that depend on the data (NaN/Inf, an overflowing scale, a bad index, a field too wide)
are found by the kernels; the Python backends word them with the helpers at the end of this
module, and NaN/Inf is always :class:`~commpress.errors.NonFiniteError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .. import rng
from ..dtypes import FLOAT_DTYPES, accumulate_dtype
from ..errors import KernelArgumentError, NonFiniteError
from ..spec.bitpack import SUPPORTED_BITS
from ..spec.blockint import QMAX
from ..spec.qsgd import QSGD_BITS, max_levels
from ..spec.topk import bad_index as bad_index
from . import schema

#: Largest value of the native schemas' ``int`` (int64).
INT64_MAX = (1 << 63) - 1

#: Field widths of the int8 / int4 ops.
BLOCKINT_BITS = tuple(sorted(QMAX, reverse=True))


def fail(op: str, message: str) -> KernelArgumentError:
    """The error to raise: ``"<op>: <message>"``."""
    return KernelArgumentError(f"{op}: {message}")


# ----- sizes the backends share ----------------------------------------------------------------
def n_blocks(n: int, block: int) -> int:
    """Blocks of ``block`` (>= 1) elements covering ``n`` (0 for an empty tensor)."""
    return 0 if n == 0 else -(-n // block)


def effective_block(n: int, block: int) -> int:
    """The block length kernels use: ``block``, or ``max(n, 1)`` for 0 or a longer block.

    A block longer than the tensor is the same single block, and the kernels' index
    arithmetic then never comes near 2**63.
    """
    whole = max(n, 1)
    return whole if block == 0 or block > whole else block


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes of ``n`` packed ``bits``-wide fields."""
    return (n * bits + 7) // 8


def sign_outputs(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty ``(scales, bits)`` that ``sign_encode`` of ``x`` fills, on ``x``'s device."""
    n = x.numel()
    scales = x.new_empty(n_blocks(n, effective_block(n, block_size)), dtype=accumulate_dtype(x.dtype))
    return scales, x.new_empty(packed_nbytes(n, 1), dtype=torch.uint8)


def qsgd_outputs(x: torch.Tensor, bits: int, bucket_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty ``(norms, packed)`` that ``qsgd_encode`` of ``x`` fills, on ``x``'s device."""
    n = x.numel()
    norms = x.new_empty(n_blocks(n, effective_block(n, bucket_size)), dtype=accumulate_dtype(x.dtype))
    return norms, x.new_empty(packed_nbytes(n, bits), dtype=torch.uint8)


def rng_key(seed: int, stream: int) -> np.uint64:
    """The RNG key of ``(seed, stream)``, ``seed`` as the native schema passes it (int64 bits)."""
    return np.uint64(rng.key(seed & rng.SEED_MASK, stream))


# ----- argument checks --------------------------------------------------------------------------
def _names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def _vector(op: str, name: str, t: Any, dtypes: Sequence[torch.dtype] | None = None) -> None:
    """A 1-D contiguous tensor (of one of ``dtypes``)."""
    if not isinstance(t, torch.Tensor):
        raise fail(op, f"{name} must be a tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise fail(op, f"{name} must have dtype {' or '.join(_names(dtypes).rsplit(', ', 1))}, got {t.dtype}")
    if t.dim() != 1:
        raise fail(op, f"{name} must be 1-D, got shape {list(t.shape)}")
    if not t.is_contiguous():
        raise fail(op, f"{name} must be contiguous")


def _same_device(op: str, name: str, t: torch.Tensor, ref: torch.Tensor, ref_name: str) -> None:
    if t.device != ref.device:
        raise fail(op, f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def _int(op: str, name: str, value: Any, low: int) -> None:
    """An int in ``[low, 2**63)`` (the schema's int is int64)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise fail(op, f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise fail(op, f"{name} must be >= {low}, got {value}")
    if value > INT64_MAX:
        raise fail(op, f"{name} must be < 2**63, got {value}")


def _floats(op: str, name: str, t: Any) -> None:
    _vector(op, name, t, FLOAT_DTYPES)


def _companion(op: str, name: str, t: Any, ref: torch.Tensor, ref_name: str, dtype: torch.dtype) -> None:
    """A 1-D contiguous tensor of ``dtype`` on ``ref``'s device."""
    _vector(op, name, t, (dtype,))
    _same_device(op, name, t, ref, ref_name)


def _residual(op: str, e: torch.Tensor | None, x: torch.Tensor) -> None:
    if e is None:
        return
    _companion(op, "residual", e, x, "x", accumulate_dtype(x.dtype))
    if e.numel() != x.numel():
        raise fail(op, f"residual has {e.numel()} elements, x has {x.numel()}")


def _bits(op: str, bits: Any, allowed: Sequence[int]) -> int:
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in allowed:
        raise fail(op, f"bits must be one of {', '.join(map(str, allowed))}, got {bits}")
    return bits


def _qsgd(op: str, bits: Any, levels: Any, bucket: Any) -> None:
    top = max_levels(_bits(op, bits, QSGD_BITS))
    if not isinstance(levels, int) or isinstance(levels, bool) or not 1 <= levels <= top:
        raise fail(op, f"levels must be in [1, {top}] for bits={bits}, got {levels}")
    _int(op, "bucket_size", bucket, 1)


def _strata(op: str, n: int, k: Any) -> None:
    """Random-k's k for n elements: one element per stratum, strata shorter than 2**32."""
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= n:
        raise fail(op, f"k must be in [0, numel={n}], got {k}")
    if n and k < 1:
        raise fail(op, "k must be >= 1 for a non-empty tensor")
    if k and n_blocks(n, k) >= 1 << 32:
        raise fail(op, f"k={k} is too small for numel={n} (strata longer than 2**32)")
    if k >= 1 << 32:
        raise fail(op, f"k={k} must be < 2**32")


def _seed(op: str, seed: Any) -> None:
    _int(op, "seed", seed, -(1 << 63))


def check_pack_bits(a: schema.PackBits) -> str:
    """``pack_bits``; returns the device type the op runs on (so do all checks)."""
    op = "pack_bits"
    _bits(op, a.bits, SUPPORTED_BITS)
    _vector(op, "fields", a.fields, (torch.uint8,))
    return a.fields.device.type


def check_unpack_bits(a: schema.UnpackBits) -> str:
    """``unpack_bits``: ``packed`` holds exactly the bytes of ``n`` fields."""
    op = "unpack_bits"
    _bits(op, a.bits, SUPPORTED_BITS)
    _vector(op, "packed", a.packed, (torch.uint8,))
    _int(op, "n", a.n, 0)
    expected = packed_nbytes(a.n, a.bits)
    if a.packed.numel() != expected:
        raise fail(
            op, f"packed holds {a.packed.numel()} bytes, but n={a.n} fields of bits={a.bits} need {expected}"
        )
    return a.packed.device.type


def check_sign_encode(a: schema.SignEncode) -> str:
    """``sign_encode``."""
    op = "sign_encode"
    _floats(op, "x", a.x)
    _int(op, "block_size", a.block_size, 0)
    _residual(op, a.residual, a.x)
    return a.x.device.type


def check_sign_decode(a: schema.SignDecode) -> str:
    """``sign_decode``: one scale per block and one bit per output."""
    op, out, block_size = "sign_decode", a.out, a.block_size
    _floats(op, "out", out)
    _companion(op, "scales", a.scales, out, "out", accumulate_dtype(out.dtype))
    _companion(op, "bits", a.bits, out, "out", torch.uint8)
    _int(op, "block_size", block_size, 0)
    n = out.numel()
    need = n_blocks(n, effective_block(n, block_size))
    if a.scales.numel() != need:
        raise fail(op, f"scales has {a.scales.numel()} elements, {n} outputs in blocks of {block_size} need {need}")
    if a.bits.numel() != packed_nbytes(n, 1):
        raise fail(op, f"bits has {a.bits.numel()} bytes, {n} outputs need {packed_nbytes(n, 1)}")
    return out.device.type


def check_qsgd_encode(a: schema.QsgdEncode) -> str:
    """``qsgd_encode``."""
    op = "qsgd_encode"
    _floats(op, "x", a.x)
    _qsgd(op, a.bits, a.levels, a.bucket_size)
    _residual(op, a.residual, a.x)
    _seed(op, a.seed)
    return a.x.device.type


def check_qsgd_decode(a: schema.QsgdDecode) -> str:
    """``qsgd_decode``: one norm per bucket and ``bits`` bits per output."""
    op, out, bits, bucket_size = "qsgd_decode", a.out, a.bits, a.bucket_size
    _floats(op, "out", out)
    _qsgd(op, bits, a.levels, bucket_size)
    _companion(op, "norms", a.norms, out, "out", accumulate_dtype(out.dtype))
    _companion(op, "packed", a.packed, out, "out", torch.uint8)
    n = out.numel()
    if a.norms.numel() != n_blocks(n, bucket_size):
        raise fail(
            op, f"norms has {a.norms.numel()} elements, {n} outputs in buckets of {bucket_size} need {n_blocks(n, bucket_size)}"
        )
    if a.packed.numel() != packed_nbytes(n, bits):
        raise fail(op, f"packed has {a.packed.numel()} bytes, {n} fields of bits={bits} need {packed_nbytes(n, bits)}")
    return out.device.type


def _blockint(op: str, bits: Any, block_size: Any) -> None:
    _bits(op, bits, BLOCKINT_BITS)
    _int(op, "block_size", block_size, 1)


def check_blockint_encode(a: schema.BlockintEncode) -> str:
    """``blockint_encode``: bits 8 or 4, block_size >= 1 (a longer block is the whole tensor)."""
    op = "blockint_encode"
    _floats(op, "x", a.x)
    _blockint(op, a.bits, a.block_size)
    return a.x.device.type


def check_blockint_encode_sr(a: schema.BlockintEncodeSr) -> str:
    """``blockint_encode_sr``: :func:`check_blockint_encode`'s arguments and an int64 seed."""
    op = "blockint_encode_sr"
    _floats(op, "x", a.x)
    _blockint(op, a.bits, a.block_size)
    _seed(op, a.seed)
    return a.x.device.type


def check_blockint_decode(a: schema.BlockintDecode) -> str:
    """``blockint_decode``: one scale per block and ``bits`` bits per output."""
    op, out, bits = "blockint_decode", a.out, a.bits
    _floats(op, "out", out)
    _blockint(op, bits, a.block_size)
    _companion(op, "scales", a.scales, out, "out", accumulate_dtype(out.dtype))
    _companion(op, "packed", a.packed, out, "out", torch.uint8)
    n = out.numel()
    need = n_blocks(n, effective_block(n, a.block_size))
    if a.scales.numel() != need:
        raise fail(op, f"scales has {a.scales.numel()} elements, {n} outputs in blocks of {a.block_size} need {need}")
    if a.packed.numel() != packed_nbytes(n, bits):
        raise fail(op, f"packed has {a.packed.numel()} bytes, {n} fields of bits={bits} need {packed_nbytes(n, bits)}")
    return out.device.type


def ternary_nbytes(n: int, block: int) -> int:
    """Bytes of the ternary kind's levels: ``n`` elements padded to whole blocks, five per byte."""
    return -(-(n_blocks(n, block) * block) // 5)


def _ternary_block(op: str, n: int, block_size: Any) -> None:
    _int(op, "block_size", block_size, 1)
    if n_blocks(n, block_size) * block_size + 4 > INT64_MAX:
        raise fail(op, f"{n} elements padded to whole blocks of block_size={block_size} pass 2**63")


def check_ternary_encode_sr(a: schema.TernaryEncodeSr) -> str:
    """``ternary_encode_sr``: float32 ``x`` (the kind's only dtype), block_size >= 1, an int64 seed."""
    op = "ternary_encode_sr"
    _vector(op, "x", a.x, (torch.float32,))
    _ternary_block(op, a.x.numel(), a.block_size)
    _seed(op, a.seed)
    return a.x.device.type


def check_ternary_decode(a: schema.TernaryDecode) -> str:
    """``ternary_decode``: float32 ``out``, one float32 scale per block, the packed bytes of the padded blocks."""
    op, out, block_size = "ternary_decode", a.out, a.block_size
    _vector(op, "out", out, (torch.float32,))
    _companion(op, "scales", a.scales, out, "out", torch.float32)
    _companion(op, "packed", a.packed, out, "out", torch.uint8)
    n = out.numel()
    _ternary_block(op, n, block_size)
    need = n_blocks(n, block_size)
    if a.scales.numel() != need:
        raise fail(op, f"scales has {a.scales.numel()} elements, {n} outputs in blocks of {block_size} need {need}")
    nbytes = ternary_nbytes(n, block_size)
    if a.packed.numel() != nbytes:
        raise fail(op, f"packed has {a.packed.numel()} bytes, {n} outputs in blocks of {block_size} need {nbytes}")
    return out.device.type


def check_topk_select(a: schema.TopkSelect) -> str:
    """``topk_select``."""
    op, x, k = "topk_select", a.x, a.k
    _floats(op, "x", x)
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= x.numel():
        raise fail(op, f"k must be in [0, numel={x.numel()}], got {k}")
    return x.device.type


def check_sparse_scatter_add(a: schema.SparseScatterAdd) -> str:
    """``sparse_scatter_add`` (the index values are checked by the kernels, before any write)."""
    op, indices, values, out = "sparse_scatter_add", a.indices, a.values, a.out
    _floats(op, "out", out)
    if len(indices) != len(values):
        raise fail(op, f"got {len(indices)} index tensors but {len(values)} value tensors")
    for p, (idx, val) in enumerate(zip(indices, values)):
        _vector(op, f"indices[{p}]", idx, (torch.int32, torch.int64))
        _same_device(op, f"indices[{p}]", idx, out, "out")
        _vector(op, f"values[{p}]", val)
        _same_device(op, f"values[{p}]", val, out, "out")
        if val.dtype != out.dtype:
            raise fail(op, f"values[{p}] has dtype {val.dtype}, out has {out.dtype}")
        if idx.numel() != val.numel():
            raise fail(op, f"indices[{p}] has {idx.numel()} elements, values[{p}] has {val.numel()}")
    return out.device.type


def check_randomk_gather(a: schema.RandomkGather) -> str:
    """``randomk_gather``."""
    op = "randomk_gather"
    _floats(op, "x", a.x)
    _strata(op, a.x.numel(), a.k)
    _seed(op, a.seed)
    return a.x.device.type


def check_randomk_scatter_add(a: schema.RandomkScatterAdd) -> str:
    """``randomk_scatter_add``."""
    op, values, out = "randomk_scatter_add", a.values, a.out
    _floats(op, "out", out)
    _vector(op, "values", values)
    _same_device(op, "values", values, out, "out")
    if values.dtype != out.dtype:
        raise fail(op, f"values has dtype {values.dtype}, out has {out.dtype}")
    _strata(op, out.numel(), values.numel())
    _seed(op, a.seed)
    return out.device.type


#: op name -> its check, called with the op's argument record (:mod:`.schema`); returns the device
#: type the op runs on.
CHECKS: dict[str, Callable[[Any], str]] = {
    "pack_bits": check_pack_bits,
    "unpack_bits": check_unpack_bits,
    "sign_encode": check_sign_encode,
    "sign_decode": check_sign_decode,
    "qsgd_encode": check_qsgd_encode,
    "qsgd_decode": check_qsgd_decode,
    "topk_select": check_topk_select,
    "sparse_scatter_add": check_sparse_scatter_add,
    "randomk_gather": check_randomk_gather,
    "randomk_scatter_add": check_randomk_scatter_add,
    "blockint_encode": check_blockint_encode,
    "blockint_decode": check_blockint_decode,
    "blockint_encode_sr": check_blockint_encode_sr,
    "ternary_encode_sr": check_ternary_encode_sr,
    "ternary_decode": check_ternary_decode,
}


# ----- data errors the Python backends find (the native ops word their own) ---------------------
def non_finite(op: str, has_residual: bool) -> NonFiniteError:
    """NaN/Inf in the values an op was given; nothing was written."""
    source = "x + residual" if has_residual else "x"
    return NonFiniteError(f"{op}: {source} contains NaN or Inf; nothing was written")


def overflow(op: str, what: str, dtype: torch.dtype) -> KernelArgumentError:
    """A computed scale or value overflows ``dtype``; nothing was written."""
    return fail(op, f"{what} overflows {dtype} (NaN or Inf; nothing was written)")


def norm_above_range(op: str, norms: torch.Tensor, limit: float, dtype: torch.dtype) -> KernelArgumentError:
    """A QSGD bucket norm above ``limit``, the largest value of ``dtype``."""
    first = float(norms[norms > limit][0])
    return fail(op, f"a bucket norm {first:g} exceeds {dtype}'s range; use a smaller bucket_size (nothing was written)")


def scaled_overflow(op: str, dtype: torch.dtype) -> KernelArgumentError:
    """Random-k's value times its stratum length overflows ``dtype``."""
    return fail(op, f"x scaled by its block length overflows {dtype}; use scaled=False")


def field_too_wide(fields: torch.Tensor, i: int, bits: int) -> KernelArgumentError:
    """``fields[i]`` does not fit in ``bits`` bits."""
    return fail("pack_bits", f"fields[{i}] = {int(fields[i])} does not fit in bits={bits} (every field must be < {1 << bits})")
