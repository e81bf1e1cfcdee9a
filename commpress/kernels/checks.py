"""Argument checks of the Python kernel backends (numba, CuPy), worded like the native ones.

The native ops check their arguments in C++ (``csrc/checks.h``); the Python backends call
these instead, so every backend rejects the same input with the same message
(``"<op>: <argument> ..."``). Numba and CuPy kernels do no bounds checking of their own, so
nothing reaches them before these checks pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .. import rng
from ..errors import KernelArgumentError

# torch dtype -> the name c10 prints (the native messages use these)
_C10_NAMES = {
    torch.float32: "Float",
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.float64: "Double",
    torch.uint8: "Byte",
    torch.int8: "Char",
    torch.int16: "Short",
    torch.int32: "Int",
    torch.int64: "Long",
    torch.bool: "Bool",
}
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def c10_name(dtype: torch.dtype) -> str:
    """The name c10 prints for ``dtype`` (``Float``, ``Half``, ...)."""
    return _C10_NAMES.get(dtype, str(dtype))


def fail(op: str, message: str) -> KernelArgumentError:
    """The error to raise: ``"<op>: <message>"``."""
    return KernelArgumentError(f"{op}: {message}")


def non_finite(op: str, has_residual: bool) -> KernelArgumentError:
    """The error for NaN/Inf in the values an encode was given (nothing was written)."""
    source = "x + residual" if has_residual else "x"
    return fail(op, f"{source} contains NaN or Inf (non-finite input; nothing was written)")


def norm_above_range(op: str, norms: torch.Tensor, limit: float, dtype: torch.dtype) -> KernelArgumentError:
    """The error for a QSGD bucket norm above ``limit``, the largest value of ``dtype``."""
    first = float(norms[norms > limit][0])
    return fail(
        op,
        f"a bucket norm {first:g} exceeds {c10_name(dtype)}'s range; use a smaller bucket_size (nothing was written)",
    )


def rng_key(seed: int, stream: int) -> np.uint64:
    """The RNG key of ``(seed, stream)``, ``seed`` as the native schema passes it.

    The schema's int is int64, so a uint64 seed arrives as its bit pattern.
    """
    return np.uint64(rng.key(seed & rng.SEED_MASK, stream))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic, residual and scale dtype: float64 for float64, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_vector(op: str, name: str, t: torch.Tensor, device: str) -> None:
    """A 1-D contiguous tensor on ``device`` ("cpu" or "cuda")."""
    if not isinstance(t, torch.Tensor):
        raise fail(op, f"{name} must be a tensor, got {type(t).__name__}")
    if t.device.type != device:
        raise fail(op, f"{name} must be a {device.upper()} tensor, got device {t.device}")
    if t.dim() != 1:
        raise fail(op, f"{name} must be 1-D, got shape {list(t.shape)}")
    if not t.is_contiguous():
        raise fail(op, f"{name} must be contiguous")


def check_dtype(op: str, name: str, t: torch.Tensor, want: torch.dtype) -> None:
    """``t`` has dtype ``want``."""
    if t.dtype != want:
        raise fail(op, f"{name} must have dtype {c10_name(want)}, got {c10_name(t.dtype)}")


def check_float(op: str, name: str, t: torch.Tensor) -> None:
    """``t`` has one of the codecs' float dtypes."""
    if t.dtype not in FLOAT_DTYPES:
        raise fail(
            op,
            f"{name} must have dtype float32, float16, bfloat16 or float64, got {c10_name(t.dtype)}",
        )


def check_same_device(
    op: str, name: str, t: torch.Tensor, ref: torch.Tensor, ref_name: str
) -> None:
    """``t`` is on the same device as ``ref``."""
    if t.device != ref.device:
        raise fail(op, f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def check_residual(op: str, e: torch.Tensor | None, x: torch.Tensor) -> None:
    """An optional residual: 1-D, contiguous, as long as x, in x's compute dtype."""
    if e is None:
        return
    check_vector(op, "residual", e, x.device.type)
    check_same_device(op, "residual", e, x, "x")
    check_dtype(op, "residual", e, compute_dtype(x.dtype))
    if e.numel() != x.numel():
        raise fail(op, f"residual has {e.numel()} elements, x has {x.numel()}")


def n_blocks(n: int, block: int) -> int:
    """Blocks of ``block`` elements covering ``n`` (0 for an empty tensor)."""
    return 0 if n == 0 else -(-n // block)


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes of ``n`` packed ``bits``-wide fields."""
    return (n * bits + 7) // 8


def check_bits(op: str, bits: int) -> None:
    """A bit-packing field width."""
    if bits not in (1, 2, 4, 8):
        raise fail(op, f"bits must be one of 1, 2, 4, 8, got {bits}")


def check_byte_vector(op: str, name: str, t: torch.Tensor, device: str) -> None:
    """A 1-D contiguous uint8 tensor on ``device``."""
    if not isinstance(t, torch.Tensor) or t.device.type != device:
        where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
        raise fail(op, f"{name} must be a {device.upper()} tensor, got device {where}")
    if t.dtype != torch.uint8:
        raise fail(op, f"{name} must have dtype uint8, got {c10_name(t.dtype)}")
    check_vector(op, name, t, device)


def check_unpack(packed: torch.Tensor, bits: int, n: int, device: str) -> None:
    """Arguments of ``unpack_bits``."""
    check_bits("unpack_bits", bits)
    check_byte_vector("unpack_bits", "packed", packed, device)
    if n < 0:
        raise fail("unpack_bits", f"n must be >= 0, got {n}")
    expected = packed_nbytes(n, bits)
    if packed.numel() != expected:
        raise fail(
            "unpack_bits",
            f"packed holds {packed.numel()} bytes, but n={n} fields of bits={bits} need {expected}",
        )


def check_sign_encode(
    x: torch.Tensor, residual: torch.Tensor | None, block_size: int, device: str
) -> int:
    """Arguments of ``sign_encode``; returns the effective block length (>= 1)."""
    op = "sign_encode"
    check_vector(op, "x", x, device)
    check_float(op, "x", x)
    if block_size < 0:
        raise fail(op, f"block_size must be >= 0, got {block_size}")
    check_residual(op, residual, x)
    return block_size or max(1, x.numel())


def check_sign_decode(
    scales: torch.Tensor, bits: torch.Tensor, block_size: int, out: torch.Tensor, device: str
) -> int:
    """Arguments of ``sign_decode``; returns the effective block length (>= 1)."""
    op = "sign_decode"
    check_vector(op, "out", out, device)
    check_float(op, "out", out)
    check_vector(op, "scales", scales, device)
    check_dtype(op, "scales", scales, compute_dtype(out.dtype))
    check_vector(op, "bits", bits, device)
    check_dtype(op, "bits", bits, torch.uint8)
    if block_size < 0:
        raise fail(op, f"block_size must be >= 0, got {block_size}")
    n = out.numel()
    block = block_size or max(1, n)
    if scales.numel() != n_blocks(n, block):
        raise fail(
            op,
            f"scales has {scales.numel()} elements, {n} outputs in blocks of {block} need {n_blocks(n, block)}",
        )
    if bits.numel() != packed_nbytes(n, 1):
        raise fail(op, f"bits has {bits.numel()} bytes, {n} outputs need {packed_nbytes(n, 1)}")
    return block


def check_qsgd_params(op: str, bits: int, levels: int, bucket: int) -> None:
    """QSGD's width, level count and bucket length."""
    if bits not in (2, 4, 8):
        raise fail(op, f"bits must be one of 2, 4, 8, got {bits}")
    top = (1 << (bits - 1)) - 1
    if not 1 <= levels <= top:
        raise fail(op, f"levels must be in [1, {top}] for bits={bits}, got {levels}")
    if bucket < 1:
        raise fail(op, f"bucket_size must be >= 1, got {bucket}")


def check_qsgd_encode(
    x: torch.Tensor, residual: torch.Tensor | None, bits: int, levels: int, bucket: int, device: str
) -> None:
    """Arguments of ``qsgd_encode``."""
    op = "qsgd_encode"
    check_vector(op, "x", x, device)
    check_float(op, "x", x)
    check_qsgd_params(op, bits, levels, bucket)
    check_residual(op, residual, x)


def check_qsgd_decode(
    norms: torch.Tensor,
    packed: torch.Tensor,
    bits: int,
    levels: int,
    bucket: int,
    out: torch.Tensor,
    device: str,
) -> None:
    """Arguments of ``qsgd_decode``."""
    op = "qsgd_decode"
    check_vector(op, "out", out, device)
    check_float(op, "out", out)
    check_qsgd_params(op, bits, levels, bucket)
    check_vector(op, "norms", norms, device)
    check_dtype(op, "norms", norms, compute_dtype(out.dtype))
    check_vector(op, "packed", packed, device)
    check_dtype(op, "packed", packed, torch.uint8)
    n = out.numel()
    if norms.numel() != n_blocks(n, bucket):
        raise fail(
            op,
            f"norms has {norms.numel()} elements, {n} outputs in buckets of {bucket} need {n_blocks(n, bucket)}",
        )
    if packed.numel() != packed_nbytes(n, bits):
        raise fail(
            op,
            f"packed has {packed.numel()} bytes, {n} fields of bits={bits} need {packed_nbytes(n, bits)}",
        )


def check_topk_select(x: torch.Tensor, k: int, device: str) -> None:
    """Arguments of ``topk_select``."""
    op = "topk_select"
    check_vector(op, "x", x, device)
    check_float(op, "x", x)
    if not 0 <= k <= x.numel():
        raise fail(op, f"k must be in [0, numel={x.numel()}], got {k}")


def check_scatter_payloads(
    indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor], out: torch.Tensor, device: str
) -> None:
    """Shapes and dtypes of ``sparse_scatter_add`` (the index values are checked by the backend)."""
    op = "sparse_scatter_add"
    check_vector(op, "out", out, device)
    check_float(op, "out", out)
    if len(indices) != len(values):
        raise fail(op, f"got {len(indices)} index tensors but {len(values)} value tensors")
    for p, (idx, val) in enumerate(zip(indices, values)):
        check_vector(op, "indices[p]", idx, device)
        check_vector(op, "values[p]", val, device)
        if idx.dtype not in (torch.int32, torch.int64):
            raise fail(
                op, f"indices[{p}] must have dtype int32 or int64, got {c10_name(idx.dtype)}"
            )
        if val.dtype != out.dtype:
            raise fail(
                op, f"values[{p}] has dtype {c10_name(val.dtype)}, out has {c10_name(out.dtype)}"
            )
        if idx.numel() != val.numel():
            raise fail(
                op, f"indices[{p}] has {idx.numel()} elements, values[{p}] has {val.numel()}"
            )


def bad_index_message(p: int, j: int, value: int, previous: int, n: int) -> str:
    """The message for the first invalid index ``indices[p][j]``."""
    if not 0 <= value < n:
        return f"indices[{p}][{j}] = {value} is out of range [0, {n})"
    return f"indices[{p}] must be strictly increasing (no duplicates): indices[{p}][{j}] = {value} follows {previous}"


def check_strata(op: str, n: int, k: int) -> None:
    """Random-k's k for n elements: strata shorter than 2**32."""
    if not 0 <= k <= n:
        raise fail(op, f"k must be in [0, numel={n}], got {k}")
    if n and k < 1:
        raise fail(op, "k must be >= 1 for a non-empty tensor")
    if k and -(-n // k) >= 1 << 32:
        raise fail(op, f"k={k} is too small for numel={n} (strata longer than 2**32)")
    if k >= 1 << 32:
        raise fail(op, f"k={k} must be < 2**32")


def check_randomk_gather(x: torch.Tensor, k: int, device: str) -> None:
    """Arguments of ``randomk_gather``."""
    op = "randomk_gather"
    check_vector(op, "x", x, device)
    check_float(op, "x", x)
    check_strata(op, x.numel(), k)


def check_randomk_scatter(values: torch.Tensor, out: torch.Tensor, device: str) -> None:
    """Arguments of ``randomk_scatter_add``."""
    op = "randomk_scatter_add"
    check_vector(op, "out", out, device)
    check_float(op, "out", out)
    check_vector(op, "values", values, device)
    if values.dtype != out.dtype:
        raise fail(op, f"values has dtype {c10_name(values.dtype)}, out has {c10_name(out.dtype)}")
    check_strata(op, out.numel(), values.numel())
