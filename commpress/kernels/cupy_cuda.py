"""The CuPy CUDA backend: the native CUDA kernels, compiled at run time, when ``_C`` has none.

A torch wheel without the CUDA extension (pure-Python install, CPU build of ``commpress._C``,
a build for another torch) still has CUDA tensors to compress. This backend compiles the very
same kernel sources as the nvcc build (``csrc/cuda/*.cu``, one source, no copies) with NVRTC
and launches them with CuPy, so CUDA tensors get the native kernels' results bit for bit.

This module owns the ops (the backend's entry points, :data:`OPS`); the rooms below it:

* :mod:`.cupy_header` -- where the sources are and what ``csrc/cuda/launch_params.h`` says
  (constants, grid and scratch functions, the kernel table), evaluated from its text.
* :mod:`.cupy_nvrtc` -- NVRTC compile with nvcc's default options, load, the per-unit
  :class:`~.cupy_nvrtc.Launcher` on torch's current stream, and :func:`unavailable`.
* :mod:`.cupy_launch` -- the launch steps the C launchers share (grids, pointer arguments,
  the block layout and the block codecs' encode sequence).

How it maps onto the native build:

* **Launches** follow the C launchers (``csrc/cuda/*.cu``, ``extern "C"``) step by step: the
  same kernels in the same order with the same grid functions, scratch offsets and flag words,
  on torch's current stream. What is written on both sides is only that sequence of calls
  with each kernel's arguments -- a language binding, which ``tests/test_cupy.py`` records and
  checks against the compiled PTX (every launched kernel compiled, every compiled kernel
  launched, every argument of the declared size). Outputs and scratch are torch tensors
  (torch's caching allocator); kernels get raw device pointers, so float16/bfloat16 tensors
  need no CuPy dtype (CuPy has no bfloat16).
* **Errors**: arguments arrive validated (:mod:`commpress.kernels.ops` runs the op's check in
  :mod:`.checks` before any backend; call these only through it). Data errors (NaN/Inf, an
  overflowing scale, a bad index) come back through the flag words of the launchers and raise
  the errors :mod:`.checks` words. Reading a flag synchronises the stream, as in the native
  binding.

Nothing here touches CUDA or CuPy before an op runs or :func:`unavailable` is called.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import rng
from ..dtypes import index_dtype
from . import checks, schema
from .cupy_header import CSRC, UNITS, launch_params
from .cupy_launch import (
    BOOLS,
    CTYPE,
    NS,
    BlockEncode,
    launch_check_finite,
    layout,
    per_item,
    per_word,
    ptr,
    read_flags,
)
from .cupy_nvrtc import Launcher, compile_unit, module_source, unavailable
from .schema import implements

OPS = frozenset(schema.OP_NAMES) - frozenset(schema.NATIVE_ONLY_OPS)  # all but int8/int4 and ternary

__all__ = [  # the ops (OPS), then entry points of the rooms below, imported from here
    "pack_bits", "unpack_bits", "sign_encode", "sign_decode", "qsgd_encode", "qsgd_decode",
    "topk_select", "sparse_scatter_add", "randomk_gather", "randomk_scatter_add",
    "CSRC", "OPS", "UNITS", "compile_unit", "launch_params", "module_source", "unavailable",
]  # fmt: skip


def _block_decode(
    unit: str, kernel: str, out: torch.Tensor, block: int, before: tuple[Any, ...], after: tuple[Any, ...] = ()
) -> None:
    """A block codec's decode, ``block_sums.cuh`` ``launch_block_decode``: one warp per 32 outputs.

    The kernel's arguments: ``before``, the layout, ``after``, then ``out``.
    """
    n = out.numel()
    if n == 0:
        return
    struct, _, _ = layout(n, block)
    per_word(Launcher(unit, out.device), NS + kernel, n, *before, struct, *after, ptr(out))


# ----- bit packing --------------------------------------------------------------------------------
@implements(schema.PackBits)
def pack_bits(a: schema.PackBits) -> torch.Tensor:
    """Pack ``bits``-wide fields LSB-first (specification: :mod:`commpress.bitpack`)."""
    fields, bits = a.fields, a.bits
    n = fields.numel()
    packed = torch.empty(checks.packed_nbytes(n, bits), dtype=torch.uint8, device=fields.device)
    if n == 0:
        return packed
    first_bad = torch.full((1,), -1, dtype=torch.int64, device=fields.device)  # UINT64_MAX
    nbytes = packed.numel()
    per_item(
        Launcher("bitpack", fields.device),
        f"commpress::pack_kernel<{bits}>",
        nbytes,
        ptr(fields),
        np.int64(n),
        ptr(packed),
        np.int64(nbytes),
        ptr(first_bad),
    )
    bad = int(first_bad.item())
    if bad >= 0:
        raise checks.field_too_wide(fields, bad, bits)
    return packed


@implements(schema.UnpackBits)
def unpack_bits(a: schema.UnpackBits) -> torch.Tensor:
    """Unpack ``n`` fields of ``bits`` bits."""
    fields = torch.empty(a.n, dtype=torch.uint8, device=a.packed.device)
    if a.n:
        per_item(
            Launcher("bitpack", a.packed.device),
            f"commpress::unpack_kernel<{a.bits}>",
            a.n,
            ptr(a.packed),
            np.int64(a.n),
            ptr(fields),
        )
    return fields


# ----- sign ---------------------------------------------------------------------------------------
@implements(schema.SignEncode)
def sign_encode(a: schema.SignEncode) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, bits)`` of sign; with ``residual``, fused error feedback (updated in place)."""
    block = checks.effective_block(a.x.numel(), a.block_size)
    scales, bits = checks.sign_outputs(a.x, block)
    if a.x.numel() == 0:
        return scales, bits
    enc = BlockEncode(Launcher("sign", a.x.device), a.x, a.residual, block)
    sums = enc.reduce("kSumAbs")
    enc.finalize(
        f"sign_finalize_kernel<{enc.t}>",
        enc.scratch_ptr(sums),
        enc.struct,
        ptr(scales),
        ptr(enc.flags),
    )
    enc.encode(
        f"sign_encode_kernel<{enc.t}, {enc.has_e}>",
        ptr(a.x),
        ptr(a.residual),
        ptr(scales),
        enc.struct,
        ptr(bits),
        ptr(enc.flags),
    )
    enc.raise_flags("sign_encode", "a block's mean magnitude", scales.dtype)
    return scales, bits


@implements(schema.SignDecode)
def sign_decode(a: schema.SignDecode) -> None:
    """``out (+)= +-scale`` per element."""
    kernel = f"sign_decode_kernel<{CTYPE[a.out.dtype]}, {BOOLS[bool(a.accumulate)]}>"
    _block_decode("sign", kernel, a.out, a.block_size, (ptr(a.scales), ptr(a.bits)))


# ----- qsgd ---------------------------------------------------------------------------------------
@implements(schema.QsgdEncode)
def qsgd_encode(a: schema.QsgdEncode) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norms, packed levels)`` of QSGD; with ``residual``, fused error feedback."""
    x = a.x
    norms, packed = checks.qsgd_outputs(x, a.bits, a.bucket_size)
    if x.numel() == 0:
        return norms, packed
    enc = BlockEncode(Launcher("qsgd", x.device), x, a.residual, a.bucket_size)
    amax: int | None = None
    if x.dtype == torch.float64:
        # squares of float64 can overflow: divide by the bucket's max magnitude first
        amax = enc.reduce("kMaxAbs")
        second = launch_params().second_reduction(enc.nblocks, enc.groups)
        sums = enc.reduce("kSumScaledSquare", amax, second)
    else:
        sums = enc.reduce("kSumSquare")
    limit = float(torch.finfo(x.dtype).max)
    enc.finalize(
        f"qsgd_finalize_kernel<{enc.t}>",
        enc.scratch_ptr(sums),
        enc.scratch_ptr(amax) if amax is not None else np.uint64(0),
        enc.struct,
        np.float64(limit),
        ptr(norms),
        ptr(enc.flags),
    )
    enc.encode(
        f"qsgd_encode_kernel<{enc.t}, {enc.has_e}, {a.bits}>",
        ptr(x),
        ptr(a.residual),
        ptr(norms),
        enc.struct,
        np.int32(a.levels),
        checks.rng_key(a.seed, rng.STREAM_QSGD),
        ptr(packed),
        ptr(enc.flags),
    )
    if enc.raise_flags("qsgd_encode", "a bucket norm", norms.dtype) & launch_params().kFlagTooBig:
        raise checks.norm_above_range("qsgd_encode", norms, limit, x.dtype)
    return norms, packed


@implements(schema.QsgdDecode)
def qsgd_decode(a: schema.QsgdDecode) -> None:
    """``out (+)= norm * ((field - s) / s)`` per element."""
    kernel = f"qsgd_decode_kernel<{CTYPE[a.out.dtype]}, {a.bits}, {BOOLS[bool(a.accumulate)]}>"
    before, after = (ptr(a.norms), ptr(a.packed)), (np.int32(a.levels),)
    _block_decode("qsgd", kernel, a.out, a.bucket_size, before, after)


# ----- top-k and sparse scatter-add ---------------------------------------------------------------
@implements(schema.TopkSelect)
def topk_select(a: schema.TopkSelect) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, values)`` of the k largest ``|x|``, exact, ties to the lower index, ascending."""
    op, x, k = "topk_select", a.x, a.k
    n = x.numel()
    index64 = index_dtype(n) == torch.int64
    indices = torch.empty(k, dtype=index_dtype(n), device=x.device)
    values = torch.empty(k, dtype=x.dtype, device=x.device)
    if n == 0:
        return indices, values
    t = CTYPE[x.dtype]
    flags = torch.zeros(1, dtype=torch.int32, device=x.device)
    launch = Launcher("topk", x.device)
    ns, lp = NS, launch_params()
    if k == 0:  # nothing to select, but x must still be finite
        launch_check_finite(launch, x, flags)
    else:
        # scratch (launch_params.h): SelectState, hist[kBins], counts, off_gt, off_eq
        scratch = torch.zeros(lp.kTopkScratchWords, dtype=torch.int64, device=x.device)
        state = scratch[: lp.kSelectStateWords]
        state[lp.kSelectRemainingWord].fill_(k)  # SelectState{prefix 0, mask 0, remaining k, pad 0}
        hist = scratch[lp.kSelectStateWords : lp.kSelectStateWords + lp.kBins]
        counts_off = 8 * (lp.kSelectStateWords + lp.kBins)
        gt_off, eq_off = counts_off + 8 * lp.kCountBlocks, counts_off + 16 * lp.kCountBlocks
        # the top key bit is the sign, always 0 after fabs: digits cover bits [0, key_bits - 1)
        shift = (64 if x.dtype == torch.float64 else 32) - 1
        first = True
        while shift > 0:
            width = min(shift, lp.kDigitBits)
            shift -= width
            hist.zero_()
            launch(
                f"{ns}histogram_kernel<{t}>",
                lp.grid_histogram(n),
                lp.kThreads,
                ptr(x),
                np.int64(n),
                ptr(state),
                np.int32(shift),
                np.int32(width),
                ptr(hist),
                ptr(flags),
                np.bool_(first),
            )
            launch(
                f"{ns}select_digit_kernel",
                1,
                lp.kThreads,
                ptr(hist),
                np.int32(shift),
                np.int32(width),
                ptr(state),
            )
            first = False
        cblocks = lp.grid_count(n)
        launch(
            f"{ns}count_kernel<{t}>",
            cblocks,
            lp.kThreads,
            ptr(x),
            np.int64(n),
            ptr(state),
            ptr(scratch, counts_off),
        )
        launch(
            f"{ns}scan_counts_kernel",
            1,
            lp.kCountBlocks,
            ptr(scratch, counts_off),
            np.int32(cblocks),
            ptr(scratch, gt_off),
            ptr(scratch, eq_off),
        )
        launch(
            f"{ns}write_kernel<{t}, {'int64_t' if index64 else 'int32_t'}>",
            cblocks,
            lp.kThreads,
            ptr(x),
            np.int64(n),
            ptr(state),
            ptr(scratch, gt_off),
            ptr(scratch, eq_off),
            ptr(indices),
            ptr(values),
        )
    if read_flags(flags) & lp.kFlagNonFinite:
        raise checks.non_finite(op, False)
    return indices, values


@implements(schema.SparseScatterAdd)
def sparse_scatter_add(a: schema.SparseScatterAdd) -> None:
    """``out[indices[p]] += values[p]`` payload by payload; every payload is validated first."""
    indices, values, out = a.indices, a.values, a.out
    if not indices:
        return
    n = out.numel()
    ns = NS
    launch = Launcher("topk", out.device)
    # All payloads are validated before any is added: the add kernels skip once first_bad is set.
    first_bad = torch.full((1,), -1, dtype=torch.int64, device=out.device)  # UINT64_MAX
    for p, idx in enumerate(indices):
        if idx.numel():
            per_item(
                launch,
                f"{ns}scatter_validate_kernel<{'int64_t' if idx.dtype == torch.int64 else 'int32_t'}>",
                idx.numel(),
                ptr(idx),
                np.int64(idx.numel()),
                np.int64(n),
                np.int64(p),
                ptr(first_bad),
            )
    t = CTYPE[out.dtype]
    for idx, val in zip(indices, values):
        if idx.numel():
            per_item(
                launch,
                f"{ns}scatter_add_kernel<{'int64_t' if idx.dtype == torch.int64 else 'int32_t'}, {t}>",
                idx.numel(),
                ptr(idx),
                ptr(val),
                np.int64(idx.numel()),
                ptr(out),
                ptr(first_bad),
            )
    code = int(first_bad.item()) & rng.SEED_MASK
    if code != rng.SEED_MASK:
        p, j = code >> 40, (code >> 1) & ((1 << 39) - 1)
        # kind bit 0: out of range, 1: not increasing; the message follows from the values
        value = int(indices[p][j])
        previous = int(indices[p][j - 1]) if j else 0
        raise checks.bad_index(p, j, value, previous, n)


# ----- random-k -----------------------------------------------------------------------------------
@implements(schema.RandomkGather)
def randomk_gather(a: schema.RandomkGather) -> torch.Tensor:
    """The k values random-k sends (one per stratum, shared-seed positions)."""
    op, x, k = "randomk_gather", a.x, a.k
    n = x.numel()
    values = torch.empty(k, dtype=x.dtype, device=x.device)
    if n == 0:
        return values
    t = CTYPE[x.dtype]
    flags = torch.zeros(1, dtype=torch.int32, device=x.device)
    launch = Launcher("randomk", x.device)
    launch_check_finite(launch, x, flags)
    per_item(
        launch,
        f"commpress::cuda::gather_kernel<{t}>",
        k,
        ptr(x),
        np.int64(n),
        np.int64(k),
        checks.rng_key(a.seed, rng.STREAM_RANDOMK),
        np.bool_(a.scaled),
        ptr(values),
        ptr(flags),
    )
    f = read_flags(flags)
    if f & launch_params().kFlagNonFinite:
        raise checks.non_finite(op, False)
    if f & launch_params().kFlagOverflow:
        raise checks.scaled_overflow(op, x.dtype)
    return values


@implements(schema.RandomkScatterAdd)
def randomk_scatter_add(a: schema.RandomkScatterAdd) -> None:
    """``out[idx] += values`` at the seed's random-k positions."""
    values, seed, out = a.values, a.seed, a.out
    k = values.numel()
    if k == 0:
        return
    per_item(
        Launcher("randomk", out.device),
        f"commpress::cuda::scatter_kernel<{CTYPE[out.dtype]}>",
        k,
        ptr(values),
        np.int64(k),
        np.int64(out.numel()),
        checks.rng_key(seed, rng.STREAM_RANDOMK),
        ptr(out),
    )
