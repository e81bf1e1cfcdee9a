"""Typed wrappers over the commpress kernels, with a backend chosen per op and device.

Backends, tried in this order for each op (:func:`backend_for`):

1. ``native``: the extension ``commpress._C`` (C++ CPU kernels, CUDA kernels when built). It is
   loaded lazily and defensively, so ``import commpress`` never fails because it is missing
   (pure-Python install, or a build for another torch) and never initialises CUDA.
2. the Python backend of the tensor's device: ``numba`` for CPU tensors
   (:mod:`commpress.kernels.numba_cpu`), ``cupy`` for CUDA tensors
   (:mod:`commpress.kernels.cupy_cuda`), each used only when its library is installed.
3. ``reference``: the pure-torch specification (:mod:`commpress.spec`, run by :mod:`.reference`).

Every backend gives bit-identical results (tests/test_native.py and tests/test_kernels.py check
it). ``COMMPRESS_BACKEND=<name>`` or :func:`use_backend` puts one backend first wherever it
has the op; ``COMMPRESS_DISABLE_NATIVE=1`` skips the extension.

One path for every op (:func:`call`): the op's check in :mod:`.checks` (the kernel contract,
stated once), then the backend. Errors: bad arguments raise
:class:`~commpress.errors.KernelArgumentError` (a :class:`~commpress.errors.CodecError`)
naming the argument; NaN/Inf in the values to encode raise
:class:`~commpress.errors.NonFiniteError`, and then nothing was written (a residual passed
for fused error feedback is unchanged). The native ops report NaN/Inf as a ValueError and
every other failure as a RuntimeError (``csrc/checks.h``); :func:`_native` maps them by kind.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

import torch

from ..dtypes import accumulate_dtype, index_dtype
from ..errors import CodecError, KernelArgumentError, NonFiniteError
from . import backends, checks, reference, schema

_OPS = backends.OP_NAMES


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


#: Backends tried for each device type, first to last.
BACKEND_ORDER = {"cpu": ("native", "numba", "reference"), "cuda": ("native", "cupy", "reference")}
BACKEND_NAMES = ("native", "numba", "cupy", "reference")
_preferred: list[str] = []  # innermost use_backend() last


def backend_for(op: str, device_type: str) -> str:
    """The backend that runs ``op`` on ``device_type`` tensors: native, numba, cupy or reference.

    A backend preferred by :func:`use_backend` or ``COMMPRESS_BACKEND`` comes first wherever it
    has the op for that device; otherwise the order of :data:`BACKEND_ORDER`.
    """
    preferred = _preferred[-1] if _preferred else os.environ.get("COMMPRESS_BACKEND", "")
    if preferred and preferred not in BACKEND_NAMES:
        raise CodecError(f"COMMPRESS_BACKEND must be one of {', '.join(BACKEND_NAMES)}, got {preferred!r}")
    order = BACKEND_ORDER.get(device_type, ("reference",))
    if preferred:
        order = (preferred, *order)
    for name in order:
        if name == "reference":
            return name
        if name == "native":
            if has_native(op, device_type):
                return name
        elif backends.supports(name, op, device_type):
            return name
    return "reference"


def backend_unavailable(name: str) -> str | None:
    """None when backend ``name`` can run here (for some op), else why not."""
    if name == "reference":
        return None
    if name == "native":
        return load_native()
    return backends.unavailable(name)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Within the block, run every op on backend ``name`` where it has the op (tests, benchmarks).

    Raises :class:`CodecError` for an unknown backend or one that cannot run here.
    """
    if name not in BACKEND_NAMES:
        raise CodecError(f"backend must be one of {', '.join(BACKEND_NAMES)}, got {name!r}")
    reason = backend_unavailable(name)
    if reason is not None:
        raise CodecError(f"backend {name!r} is not available: {reason}")
    _preferred.append(name)
    try:
        yield
    finally:
        _preferred.pop()


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


def _register_fakes() -> None:
    # Shape functions so torch.compile / opcheck can trace the ops without running them.
    packed_nbytes = checks.packed_nbytes

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
        return checks.sign_outputs(x, block_size)

    @torch.library.register_fake("commpress::qsgd_encode")
    def _qsgd_encode_fake(
        x: torch.Tensor, residual: torch.Tensor | None, bits: int, levels: int, bucket_size: int, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return checks.qsgd_outputs(x, bits, bucket_size)

    @torch.library.register_fake("commpress::topk_select")
    def _topk_fake(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return x.new_empty(k, dtype=index_dtype(x.numel())), x.new_empty(k)

    @torch.library.register_fake("commpress::randomk_gather")
    def _randomk_gather_fake(x: torch.Tensor, k: int, seed: int, scaled: bool) -> torch.Tensor:
        return x.new_empty(k)

    @torch.library.register_fake("commpress::blockint_encode")
    def _blockint_encode_fake(x: torch.Tensor, bits: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.numel()
        nb = checks.n_blocks(n, checks.effective_block(n, block_size))
        return x.new_empty(nb, dtype=accumulate_dtype(x.dtype)), x.new_empty(packed_nbytes(n, bits), dtype=torch.uint8)

    @torch.library.register_fake("commpress::blockint_encode_sr")
    def _blockint_encode_sr_fake(x: torch.Tensor, bits: int, block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _blockint_encode_fake(x, bits, block_size)

    @torch.library.register_fake("commpress::ternary_encode_sr")
    def _ternary_encode_sr_fake(x: torch.Tensor, block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.numel()
        nbytes = checks.ternary_nbytes(n, block_size)
        return x.new_empty(checks.n_blocks(n, block_size)), x.new_empty(nbytes, dtype=torch.uint8)

    def _writes_out_only(*args: Any) -> None:
        return None  # these ops only write into the ``out`` they are given

    for op in ("sign_decode", "qsgd_decode", "sparse_scatter_add", "randomk_scatter_add", "blockint_decode",
               "ternary_decode"):
        torch.library.register_fake(f"commpress::{op}")(_writes_out_only)


def _native(op: str, args: tuple[Any, ...]) -> Any:
    """Call a native op; its failures become NonFiniteError (ValueError) or KernelArgumentError."""
    try:
        return getattr(torch.ops.commpress, op).default(*args)
    except ValueError as exc:  # the native kind of NaN/Inf input (csrc/checks.h check_finite)
        raise NonFiniteError(str(exc).splitlines()[0]) from exc
    except RuntimeError as exc:
        message = str(exc).splitlines()[0]
        if not message.startswith(f"{op}:"):
            raise  # not one of the op's own checks (e.g. a CUDA error): leave it alone
        raise KernelArgumentError(message) from exc


def call(op: str, *args: Any) -> Any:
    """Run kernel op ``op`` with the native schema's arguments: check them, then run the backend.

    The one path every op takes (the typed wrappers below build ``args`` and call this): the
    arguments become the op's record (:mod:`.schema`), :data:`commpress.kernels.checks.CHECKS`
    validates it once, then the backend :func:`backend_for` picks runs it.
    """
    if op not in checks.CHECKS:
        raise CodecError(f"unknown kernel op {op!r}; expected one of {', '.join(_OPS)}")
    a = schema.SIGNATURES[op](*args)
    device_type = checks.CHECKS[op](a)
    backend = backend_for(op, device_type)
    if backend == "native":
        return _native(op, tuple(a))
    module = reference if backend == "reference" else backends.module(backend)
    return getattr(module, op)(*a)


class _Checked:
    """``checked.<op>(*args)`` is ``call("<op>", *args)``: the ops with the native schemas."""

    def __getattr__(self, op: str) -> Any:
        if op not in checks.CHECKS:
            raise AttributeError(op)
        return functools.partial(call, op)


#: Every op with the native schema's arguments, validated, on the backend of its device.
checked = _Checked()


def _signed_seed(seed: int) -> int:
    # the schema's int is int64; uint64 seeds travel as their bit pattern
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 64:
        raise CodecError(f"seed must be an int in [0, 2**64), got {seed!r}")
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _contiguous(t: Any) -> Any:
    # the wrappers accept any layout; the kernels take contiguous tensors
    return t.contiguous() if isinstance(t, torch.Tensor) else t


# ----- bit packing ------------------------------------------------------------------------------
def pack_bits(fields: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a 1-D uint8 tensor of ``bits``-wide fields LSB-first (see :mod:`commpress.spec.bitpack`)."""
    result: torch.Tensor = call("pack_bits", _contiguous(fields), bits)
    return result


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Unpack ``n`` fields of ``bits`` bits from bytes made by :func:`pack_bits`."""
    result: torch.Tensor = call("unpack_bits", _contiguous(packed), bits, n)
    return result


# ----- sign ---------------------------------------------------------------------------------------
def sign_encode(
    x: torch.Tensor, block_size: int, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, bits)`` of the sign codec for 1-D ``x``; see :func:`commpress.spec.sign.encode_reference`.

    With ``residual``: fused error feedback, ``residual`` is updated in place.
    """
    scales, bits = call("sign_encode", x, residual, block_size)
    return scales, bits


@schema.implements(schema.SignDecode)
def sign_decode(a: schema.SignDecode) -> None:
    """``out = decode(scales, bits)``, or ``+=`` with ``accumulate``, for sign (1-D contiguous ``out``)."""
    call("sign_decode", *a)


# ----- qsgd ---------------------------------------------------------------------------------------
def qsgd_encode(
    x: torch.Tensor,
    bits: int,
    levels: int,
    bucket_size: int,
    seed: int,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norms, packed)`` of QSGD for 1-D ``x``; see :func:`commpress.spec.qsgd.encode_reference`.

    With ``residual``: fused error feedback, ``residual`` is updated in place.
    """
    norms, packed = call("qsgd_encode", x, residual, bits, levels, bucket_size, _signed_seed(seed))
    return norms, packed


@schema.implements(schema.QsgdDecode)
def qsgd_decode(a: schema.QsgdDecode) -> None:
    """``out = decode(norms, packed)``, or ``+=`` with ``accumulate``, for QSGD (1-D contiguous ``out``)."""
    call("qsgd_decode", *a)


# ----- top-k --------------------------------------------------------------------------------------
@schema.implements(schema.TopkSelect)
def topk_select(a: schema.TopkSelect) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, values)`` of the k largest ``|x|``, exact, indices ascending; see the reference."""
    indices, values = call("topk_select", *a)
    return indices, values


@schema.implements(schema.SparseScatterAdd)
def sparse_scatter_add(a: schema.SparseScatterAdd) -> None:
    """``out[indices[p]] += values[p]`` for every payload p, in order (bounds/duplicate-checked)."""
    call("sparse_scatter_add", list(a.indices), list(a.values), a.out)


# ----- random-k -----------------------------------------------------------------------------------
def randomk_gather(x: torch.Tensor, k: int, seed: int, scaled: bool) -> torch.Tensor:
    """The k values random-k sends for 1-D ``x``; see :func:`commpress.spec.randomk.gather_reference`."""
    values: torch.Tensor = call("randomk_gather", x, k, _signed_seed(seed), scaled)
    return values


def randomk_scatter_add(values: torch.Tensor, seed: int, out: torch.Tensor) -> None:
    """``out[idx] += values`` at the seed's random-k indices (1-D contiguous ``out``)."""
    call("randomk_scatter_add", _contiguous(values), _signed_seed(seed), out)


# ----- int8 / int4 --------------------------------------------------------------------------------
def blockint_encode(x: torch.Tensor, bits: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, packed)`` of the int8/int4 codecs for 1-D ``x``; see :func:`commpress.spec.blockint.encode_reference`."""
    scales, packed = call("blockint_encode", x, bits, block_size)
    return scales, packed


def blockint_encode_sr(x: torch.Tensor, bits: int, block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`blockint_encode` with stochastic rounding; see :func:`commpress.spec.blockint.encode_stochastic_reference`."""
    scales, packed = call("blockint_encode_sr", x, bits, block_size, _signed_seed(seed))
    return scales, packed


@schema.implements(schema.BlockintDecode)
def blockint_decode(a: schema.BlockintDecode) -> None:
    """``out = decode(scales, packed)``, or ``+=`` with ``accumulate``, for int8/int4 (1-D contiguous ``out``)."""
    call("blockint_decode", *a)


# ----- ternary ------------------------------------------------------------------------------------
def ternary_encode_sr(x: torch.Tensor, block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, packed)`` of the ternary kind for 1-D float32 ``x``; see :func:`commpress.spec.ternary.encode_stochastic`."""
    scales, packed = call("ternary_encode_sr", x, block_size, _signed_seed(seed))
    return scales, packed


@schema.implements(schema.TernaryDecode)
def ternary_decode(a: schema.TernaryDecode) -> None:
    """``out = decode(scales, packed)`` of the ternary kind (1-D contiguous float32 ``out``)."""
    call("ternary_decode", *a)
