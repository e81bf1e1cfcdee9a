"""The numba CPU backend: every commpress op, JIT-compiled, for installs without the extension.

A pure-Python install (``COMMPRESS_PURE_PYTHON=1``, or a wheel built for another torch) has no
``commpress._C``; with numba present, :mod:`commpress.kernels.ops` runs these kernels instead of the
much slower pure-torch references. They implement the same specification (the references in
``commpress/spec/``) bit for bit: the same fixed summation order (``tree_sum``), the same
correctly rounded square root, the same counter-based RNG (:mod:`commpress.rng`), the same
rounding to float16/bfloat16 at the same steps; ``tests/test_kernels.py`` checks every op
against the reference like the native backends.

How the dtypes are handled: the kernels compute on float32 (float64 for float64) arrays. A
float16/bfloat16 input is widened to float32 first (exact), and every value the reference
rounds to the input dtype is rounded here by :func:`_round` (round to nearest even, computed
in float64 with power-of-two quanta, so it is exact). float32/float64 arrays are used in
place, with no copy.

Arguments arrive validated: :mod:`commpress.kernels.ops` runs the op's check
(:mod:`commpress.kernels.checks`) before any backend, and numba does no bounds checking, so
call these only through it. Kernels return a status code instead of raising (numba raises
poorly); the wrappers turn a status into the error :mod:`.checks` words (NaN/Inf:
:class:`~commpress.errors.NonFiniteError`). Compiled code is cached on disk (``cache=True``),
so only the first use on a machine pays the compile.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
import torch

from .. import rng
from ..dtypes import accumulate_dtype, index_dtype
from . import checks, schema
from .schema import implements

OPS = frozenset(schema.OP_NAMES) - frozenset(schema.NATIVE_ONLY_OPS)  # all but int8/int4 and ternary

# Rounding modes: the dtype whose values the reference rounds to.
_EXACT, _HALF, _BF16 = 0, 1, 2
_MODE = {torch.float32: _EXACT, torch.float64: _EXACT, torch.float16: _HALF, torch.bfloat16: _BF16}
# Status codes of the encode kernels.
_OK, _NON_FINITE, _OVERFLOW, _ABOVE_LIMIT = 0, 1, 2, 3


@lru_cache(maxsize=1)
def unavailable() -> str | None:
    """None when numba can be imported, else the reason (the backend is then skipped)."""
    try:
        import numba  # noqa: F401
    except ImportError as exc:
        return f"numba not importable: {exc}"
    return None


@lru_cache(maxsize=1)
def _kernels() -> Any:
    # Compiled on first use (and cached on disk), so importing commpress never pays for it.
    from . import _numba_kernels

    return _numba_kernels


# ----- dtype plumbing --------------------------------------------------------------------------
def _as_compute(t: torch.Tensor) -> torch.Tensor:
    """``t`` in its compute dtype: the same tensor for float32/64, an exact float32 copy else."""
    ct = accumulate_dtype(t.dtype)
    return t if t.dtype == ct else t.to(ct)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


def _finish_write(out: torch.Tensor, work: torch.Tensor) -> None:
    """Copy the float32 working copy of a float16/bfloat16 ``out`` back (exact: values fit)."""
    if work is not out:
        out.copy_(work)


# ----- bit packing -------------------------------------------------------------------------------
@implements(schema.PackBits)
def pack_bits(a: schema.PackBits) -> torch.Tensor:
    """Pack ``bits``-wide fields LSB-first (specification: :mod:`commpress.spec.bitpack`)."""
    packed = torch.empty(checks.packed_nbytes(a.fields.numel(), a.bits), dtype=torch.uint8)
    bad = _kernels().pack(_np(a.fields), a.bits, _np(packed))
    if bad >= 0:
        raise checks.field_too_wide(a.fields, bad, a.bits)
    return packed


@implements(schema.UnpackBits)
def unpack_bits(a: schema.UnpackBits) -> torch.Tensor:
    """Unpack ``n`` fields of ``bits`` bits."""
    fields = torch.empty(a.n, dtype=torch.uint8)
    _kernels().unpack(_np(a.packed), a.bits, a.n, _np(fields))
    return fields


# ----- sign --------------------------------------------------------------------------------------
def _raise_encode_status(op: str, status: int, has_e: bool, what: str, dtype: torch.dtype) -> None:
    if status == _NON_FINITE:
        raise checks.non_finite(op, has_e)
    if status == _OVERFLOW:
        raise checks.overflow(op, what, accumulate_dtype(dtype))


def _residual_np(residual: torch.Tensor | None, xc: torch.Tensor) -> np.ndarray:
    """The residual's array, or an empty one of the compute dtype (numba needs a typed array)."""
    return _np(residual) if residual is not None else _np(xc[:0])


@implements(schema.SignEncode)
def sign_encode(a: schema.SignEncode) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, bits)`` of sign; with ``residual``, fused error feedback (updated in place)."""
    x, residual = a.x, a.residual
    block = checks.effective_block(x.numel(), a.block_size)
    scales, bits = checks.sign_outputs(x, block)
    if x.numel() == 0:
        return scales, bits
    xc = _as_compute(x)
    status = _kernels().sign_encode(
        _np(xc),
        _residual_np(residual, xc),
        residual is not None,
        _MODE[x.dtype],
        block,
        _np(scales),
        _np(bits),
    )
    _raise_encode_status(
        "sign_encode", status, residual is not None, "a block's mean magnitude", x.dtype
    )
    return scales, bits


def _block_decode(
    kernel: str, out: torch.Tensor, block_size: int, accumulate: bool, *head: Any
) -> None:
    """Run the block codec decode ``kernel(*head, block, out, accumulate, mode)`` into ``out``.

    ``out`` is written through its compute-dtype working copy (sign and QSGD share this).
    """
    block = checks.effective_block(out.numel(), block_size)
    if out.numel() == 0:
        return
    work = _as_compute(out)
    getattr(_kernels(), kernel)(*head, block, _np(work), bool(accumulate), _MODE[out.dtype])
    _finish_write(out, work)


@implements(schema.SignDecode)
def sign_decode(a: schema.SignDecode) -> None:
    """``out (+)= +-scale`` per element."""
    _block_decode("sign_decode", a.out, a.block_size, a.accumulate, _np(a.scales), _np(a.bits))


# ----- qsgd --------------------------------------------------------------------------------------
def _level_count(levels: int, ct: torch.dtype) -> np.floating[Any]:
    """QSGD's level count s as the kernels' compute float (float64 for float64, else float32)."""
    return np.float64(levels) if ct == torch.float64 else np.float32(levels)


@implements(schema.QsgdEncode)
def qsgd_encode(a: schema.QsgdEncode) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norms, packed levels)`` of QSGD; with ``residual``, fused error feedback."""
    x, residual = a.x, a.residual
    bucket_size = checks.effective_block(x.numel(), a.bucket_size)
    norms, packed = checks.qsgd_outputs(x, a.bits, bucket_size)
    ct = norms.dtype
    if x.numel() == 0:
        return norms, packed
    xc = _as_compute(x)
    limit = float(torch.finfo(x.dtype).max)
    status = _kernels().qsgd_encode(
        _np(xc),
        _residual_np(residual, xc),
        residual is not None,
        _MODE[x.dtype],
        ct == torch.float64,
        a.bits,
        _level_count(a.levels, ct),
        bucket_size,
        checks.rng_key(a.seed, rng.STREAM_QSGD),
        limit,
        _np(norms),
        _np(packed),
    )
    _raise_encode_status("qsgd_encode", status, residual is not None, "a bucket norm", x.dtype)
    if status == _ABOVE_LIMIT:
        raise checks.norm_above_range("qsgd_encode", norms, limit, x.dtype)
    return norms, packed


@implements(schema.QsgdDecode)
def qsgd_decode(a: schema.QsgdDecode) -> None:
    """``out (+)= norm * ((field - s) / s)`` per element."""
    level_count = _level_count(a.levels, accumulate_dtype(a.out.dtype))  # the working copy's
    head = (_np(a.norms), _np(a.packed), a.bits, level_count)
    _block_decode("qsgd_decode", a.out, a.bucket_size, a.accumulate, *head)


# ----- top-k -------------------------------------------------------------------------------------
@implements(schema.TopkSelect)
def topk_select(a: schema.TopkSelect) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, values)`` of the k largest ``|x|``, exact, ties to the lower index, ascending."""
    x = a.x
    idx = torch.empty(a.k, dtype=torch.int64)
    if not _kernels().topk_select(_np(_as_compute(x)), a.k, _np(idx)):
        raise checks.non_finite("topk_select", False)
    return idx.to(index_dtype(x.numel())), x[idx]


@implements(schema.SparseScatterAdd)
def sparse_scatter_add(a: schema.SparseScatterAdd) -> None:
    """``out[indices[p]] += values[p]`` payload by payload; every payload is checked first."""
    out = a.out
    n = out.numel()
    longs = [idx.long() for idx in a.indices]
    for p, idx in enumerate(longs):
        j = int(_kernels().first_bad_index(_np(idx), n))
        if j >= 0:
            prev = int(idx[j - 1]) if j else 0
            raise checks.bad_index(p, j, int(idx[j]), prev, n)
    work = _as_compute(out)
    mode = _MODE[out.dtype]
    for idx, val in zip(longs, a.values):
        _kernels().scatter_add(_np(idx), _np(_as_compute(val)), _np(work), mode)
    _finish_write(out, work)


# ----- random-k ----------------------------------------------------------------------------------
@implements(schema.RandomkGather)
def randomk_gather(a: schema.RandomkGather) -> torch.Tensor:
    """The k values random-k sends (one per stratum, shared-seed positions)."""
    x = a.x
    xc = _as_compute(x)
    values = torch.empty(a.k, dtype=xc.dtype)
    if x.numel() == 0:
        return values.to(x.dtype)
    status = _kernels().randomk_gather(
        _np(xc),
        a.k,
        checks.rng_key(a.seed, rng.STREAM_RANDOMK),
        bool(a.scaled),
        _MODE[x.dtype],
        xc.dtype == torch.float64,
        _np(values),
    )
    if status == _NON_FINITE:
        raise checks.non_finite("randomk_gather", False)
    if status == _OVERFLOW:
        raise checks.scaled_overflow("randomk_gather", x.dtype)
    return values if values.dtype == x.dtype else values.to(x.dtype)


@implements(schema.RandomkScatterAdd)
def randomk_scatter_add(a: schema.RandomkScatterAdd) -> None:
    """``out[idx] += values`` at the seed's random-k positions."""
    if a.values.numel() == 0:
        return
    work = _as_compute(a.out)
    _kernels().randomk_scatter_add(
        _np(_as_compute(a.values)),
        checks.rng_key(a.seed, rng.STREAM_RANDOMK),
        _np(work),
        _MODE[a.out.dtype],
    )
    _finish_write(a.out, work)


def warm_up() -> None:
    """Compile (or load from the disk cache) every kernel for float32, so timing excludes it.

    Calls the kernels directly with arguments known to be valid.
    """
    x = torch.randn(100)
    e = torch.zeros(100)
    s, b = sign_encode(x, e, 16)
    sign_decode(s, b, 16, torch.zeros(100))
    nr, pk = qsgd_encode(x, e, 4, 7, 32, 1)
    qsgd_decode(nr, pk, 4, 7, 32, torch.zeros(100))
    i, v = topk_select(x, 5)
    sparse_scatter_add([i], [v], torch.zeros(100))
    randomk_scatter_add(randomk_gather(x, 5, 1, True), 1, torch.zeros(100))
    unpack_bits(pack_bits(torch.ones(9, dtype=torch.uint8), 1), 1, 9)
