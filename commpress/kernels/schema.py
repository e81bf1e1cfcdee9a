"""The kernel ops' argument lists, stated once for Python: one typed record per op.

``csrc/registration.cpp`` declares each op's schema for the dispatcher; this module states the
same arguments, in the same order and with the same names and defaults, for everything in
Python that takes them: the checks (:mod:`.checks` reads ``a.out``, ``a.bucket_size``, ...),
the Python backends (:mod:`.numba_cpu`, :mod:`.cupy_cuda`) and the typed wrappers of
:mod:`.ops` whose arguments are the schema's. A backend function is written against its op's
record and wrapped by :func:`implements`, which gives it the op's positional signature (checked
by mypy, shown by ``help``), so ``cupy_cuda.qsgd_decode(norms, packed, ...)`` still reads like
``torch.ops.commpress.qsgd_decode``. A new op is one record and one line of :data:`SIGNATURES`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, ParamSpec, TypeVar

import torch

P = ParamSpec("P")
A = TypeVar("A")
R = TypeVar("R")


class PackBits(NamedTuple):
    """``pack_bits(Tensor fields, int bits) -> Tensor``."""

    fields: torch.Tensor
    bits: int


class UnpackBits(NamedTuple):
    """``unpack_bits(Tensor packed, int bits, int n) -> Tensor``."""

    packed: torch.Tensor
    bits: int
    n: int


class SignEncode(NamedTuple):
    """``sign_encode(Tensor x, Tensor(a!)? residual, int block_size) -> (scales, bits)``."""

    x: torch.Tensor
    residual: torch.Tensor | None
    block_size: int


class SignDecode(NamedTuple):
    """``sign_decode(Tensor scales, Tensor bits, int block_size, Tensor(a!) out, bool accumulate=True)``."""

    scales: torch.Tensor
    bits: torch.Tensor
    block_size: int
    out: torch.Tensor
    accumulate: bool = True


class QsgdEncode(NamedTuple):
    """``qsgd_encode(Tensor x, Tensor(a!)? residual, int bits, int levels, int bucket_size, int seed)``.

    ``seed`` is the schema's int64: a uint64 seed travels as its bit pattern.
    """

    x: torch.Tensor
    residual: torch.Tensor | None
    bits: int
    levels: int
    bucket_size: int
    seed: int


class QsgdDecode(NamedTuple):
    """``qsgd_decode(Tensor norms, Tensor packed, int bits, int levels, int bucket_size, Tensor(a!) out, bool accumulate=True)``."""

    norms: torch.Tensor
    packed: torch.Tensor
    bits: int
    levels: int
    bucket_size: int
    out: torch.Tensor
    accumulate: bool = True


class TopkSelect(NamedTuple):
    """``topk_select(Tensor x, int k) -> (Tensor indices, Tensor values)``."""

    x: torch.Tensor
    k: int


class SparseScatterAdd(NamedTuple):
    """``sparse_scatter_add(Tensor[] indices, Tensor[] values, Tensor(a!) out)``."""

    indices: Sequence[torch.Tensor]
    values: Sequence[torch.Tensor]
    out: torch.Tensor


class RandomkGather(NamedTuple):
    """``randomk_gather(Tensor x, int k, int seed, bool scaled) -> Tensor`` (seed: int64 bits)."""

    x: torch.Tensor
    k: int
    seed: int
    scaled: bool


class RandomkScatterAdd(NamedTuple):
    """``randomk_scatter_add(Tensor values, int seed, Tensor(a!) out)`` (seed: int64 bits)."""

    values: torch.Tensor
    seed: int
    out: torch.Tensor


class BlockintEncode(NamedTuple):
    """``blockint_encode(Tensor x, int bits, int block_size) -> (Tensor scales, Tensor packed)``."""

    x: torch.Tensor
    bits: int
    block_size: int


class BlockintEncodeSr(NamedTuple):
    """``blockint_encode_sr(Tensor x, int bits, int block_size, int seed) -> (Tensor scales, Tensor packed)`` (seed: int64 bits)."""

    x: torch.Tensor
    bits: int
    block_size: int
    seed: int


class BlockintDecode(NamedTuple):
    """``blockint_decode(Tensor scales, Tensor packed, int bits, int block_size, Tensor(a!) out, bool accumulate=True)``."""

    scales: torch.Tensor
    packed: torch.Tensor
    bits: int
    block_size: int
    out: torch.Tensor
    accumulate: bool = True


class TernaryEncodeSr(NamedTuple):
    """``ternary_encode_sr(Tensor x, int block_size, int seed) -> (Tensor scales, Tensor packed)`` (seed: int64 bits).

    float32 ``x`` only: the ternary kind stores the FSDP store's float32 tensors, and its
    specification (:mod:`commpress.spec.ternary`) computes in float32; other dtypes are refused.
    """

    x: torch.Tensor
    block_size: int
    seed: int


class TernaryDecode(NamedTuple):
    """``ternary_decode(Tensor scales, Tensor packed, int block_size, Tensor(a!) out)`` (float32 ``scales`` and ``out``)."""

    scales: torch.Tensor
    packed: torch.Tensor
    block_size: int
    out: torch.Tensor


#: op name -> its argument record, in the order of ``csrc/registration.cpp``.
SIGNATURES: dict[str, Callable[..., tuple[Any, ...]]] = {
    "pack_bits": PackBits,
    "unpack_bits": UnpackBits,
    "sign_encode": SignEncode,
    "sign_decode": SignDecode,
    "qsgd_encode": QsgdEncode,
    "qsgd_decode": QsgdDecode,
    "topk_select": TopkSelect,
    "sparse_scatter_add": SparseScatterAdd,
    "randomk_gather": RandomkGather,
    "randomk_scatter_add": RandomkScatterAdd,
    "blockint_encode": BlockintEncode,
    "blockint_decode": BlockintDecode,
    "blockint_encode_sr": BlockintEncodeSr,
    "ternary_encode_sr": TernaryEncodeSr,
    "ternary_decode": TernaryDecode,
}

#: Every commpress kernel op.
OP_NAMES = tuple(SIGNATURES)

#: The int8/int4 ops: native CPU and CUDA kernels and the reference only (no numba or CuPy
#: kernels); without the extension :mod:`commpress.kernels.blockint` runs its torch path.
BLOCKINT_OPS = ("blockint_encode", "blockint_decode", "blockint_encode_sr")

#: The ternary ops (the FSDP store's smallest kind): native and reference only too; without the
#: extension :mod:`commpress.kernels.ternary` runs the specification's torch code.
TERNARY_OPS = ("ternary_encode_sr", "ternary_decode")

#: The ops with native kernels and the reference only (no numba or CuPy kernels).
NATIVE_ONLY_OPS = BLOCKINT_OPS + TERNARY_OPS


def implements(record: Callable[P, A]) -> Callable[[Callable[[A], R]], Callable[P, R]]:
    """Decorator: ``impl(a: Record)`` becomes a function with the op's positional signature.

    The result builds the record from its arguments (a wrong count or name is a TypeError, as
    for any Python call) and runs ``impl`` on it; the record's parameters are its signature.
    """

    def wrap(impl: Callable[[A], R]) -> Callable[P, R]:
        @functools.wraps(impl)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            return impl(record(*args, **kwargs))

        run.__signature__ = inspect.signature(record).replace(  # type: ignore[attr-defined]
            return_annotation=inspect.signature(impl).return_annotation
        )
        return run

    return wrap
