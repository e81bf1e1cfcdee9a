"""Typed wrappers over the commpress kernels, with a backend chosen per op and device.

Backends, tried in this order for each op (:func:`backend_for`):

1. ``native``: the extension ``commpress._C`` (C++ CPU kernels, CUDA kernels when built). It is
   loaded lazily and defensively, so ``import commpress`` never fails because it is missing
   (pure-Python install, or a build for another torch) and never initialises CUDA.
2. the Python backend of the tensor's device: ``numba`` for CPU tensors
   (:mod:`commpress.kernels.numba_cpu`), ``cupy`` for CUDA tensors
   (:mod:`commpress.kernels.cupy_cuda`), each used only when its library is installed.
3. ``reference``: the pure-torch specification (``commpress/codecs/*.py``).

Every backend gives bit-identical results (tests/test_native.py and tests/test_kernels.py check
it). ``COMMPRESS_BACKEND=<name>`` or :func:`use_backend` puts one backend first wherever it
has the op; ``COMMPRESS_DISABLE_NATIVE=1`` skips the extension.

Errors: bad arguments raise :class:`~commpress.errors.CodecError` naming the argument, from
every path; NaN/Inf in the values to encode raise its subclass :class:`NonFiniteError`, and
then nothing was written (a residual passed for fused error feedback is unchanged).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache
from typing import Any, TypeVar

import torch

from ..bitpack import check_bits, pack_bits_reference, packed_nbytes, unpack_bits_reference
from ..errors import CodecError, KernelArgumentError, NonFiniteError
from . import backends

_OPS = backends.OP_NAMES
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_R = TypeVar("_R")


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
        scales: torch.Tensor,
        bits: torch.Tensor,
        block_size: int,
        out: torch.Tensor,
        accumulate: bool = True,
    ) -> None:
        return None

    @torch.library.register_fake("commpress::qsgd_encode")
    def _qsgd_encode_fake(
        x: torch.Tensor,
        residual: torch.Tensor | None,
        bits: int,
        levels: int,
        bucket_size: int,
        seed: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.numel()
        nbytes = (n * bits + 7) // 8
        return x.new_empty(_nblocks(n, bucket_size), dtype=compute(x.dtype)), x.new_empty(
            nbytes, dtype=torch.uint8
        )

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
    def _scatter_fake(
        indices: list[torch.Tensor], values: list[torch.Tensor], out: torch.Tensor
    ) -> None:
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


def _run(op: str, device_type: str, args: tuple[Any, ...], reference: Callable[[], _R]) -> _R:
    """Run ``op`` on the backend :func:`backend_for` picks; ``args`` follow the native schema."""
    backend = backend_for(op, device_type)
    if backend == "native":
        return _native(op, getattr(torch.ops.commpress, op).default, *args)
    if backend == "reference":
        return reference()
    try:
        result: _R = getattr(backends.module(backend), op)(*args)
    except KernelArgumentError as exc:
        if "non-finite input" in str(exc):
            raise NonFiniteError(str(exc)) from exc
        raise
    return result


def _signed_seed(seed: int) -> int:
    # the schema's int is int64; uint64 seeds travel as their bit pattern
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 64:
        raise CodecError(f"seed must be an int in [0, 2**64), got {seed!r}")
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _check_vector(
    name: str, t: torch.Tensor, dtypes: Sequence[torch.dtype] = _FLOAT_DTYPES
) -> None:
    if not isinstance(t, torch.Tensor):
        raise CodecError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or t.dtype not in dtypes:
        raise CodecError(
            f"{name} must be a 1-D tensor of {'/'.join(str(d) for d in dtypes)}, got {t.dtype} {tuple(t.shape)}"
        )
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
        raise CodecError(
            f"fields must be a 1-D uint8 tensor, got {fields.dtype} {tuple(fields.shape)}"
        )
    fields = fields.contiguous()
    return _run(
        "pack_bits", fields.device.type, (fields, bits), lambda: pack_bits_reference(fields, bits)
    )


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Unpack ``n`` fields of ``bits`` bits from bytes made by :func:`pack_bits`."""
    check_bits(bits)
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise CodecError(
            f"packed must be a 1-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}"
        )
    if packed.numel() != packed_nbytes(n, bits):
        raise CodecError(
            f"packed holds {packed.numel()} bytes, {n} fields of {bits} bits need {packed_nbytes(n, bits)}"
        )
    packed = packed.contiguous()
    return _run(
        "unpack_bits",
        packed.device.type,
        (packed, bits, n),
        lambda: unpack_bits_reference(packed, bits, n),
    )


# ----- sign ---------------------------------------------------------------------------------------
def sign_encode(
    x: torch.Tensor, block_size: int, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, bits)`` of the sign codec for 1-D ``x``; see :func:`commpress.codecs.sign.encode_reference`.

    With ``residual``: fused error feedback, ``residual`` is updated in place.
    """
    _check_vector("x", x)
    _check_residual(residual, x)
    from ..codecs.sign import encode_reference

    return _run(
        "sign_encode",
        x.device.type,
        (x, residual, block_size),
        lambda: encode_reference(x, block_size, residual),
    )


def sign_decode(
    scales: torch.Tensor,
    bits: torch.Tensor,
    block_size: int,
    out: torch.Tensor,
    accumulate: bool = True,
) -> None:
    """``out = decode(scales, bits)``, or ``+=`` with ``accumulate``, for sign (1-D contiguous ``out``)."""
    _check_vector("out", out)
    from ..codecs.sign import decode_reference

    _run(
        "sign_decode",
        out.device.type,
        (scales, bits, block_size, out, accumulate),
        lambda: decode_reference(scales, bits, block_size, out, accumulate),
    )


# ----- qsgd ---------------------------------------------------------------------------------------
def qsgd_encode(
    x: torch.Tensor,
    bits: int,
    levels: int,
    bucket_size: int,
    seed: int,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norms, packed)`` of QSGD for 1-D ``x``; see :func:`commpress.codecs.qsgd.encode_reference`.

    With ``residual``: fused error feedback, ``residual`` is updated in place.
    """
    _check_vector("x", x)
    _check_residual(residual, x)
    signed = _signed_seed(seed)
    from ..codecs.qsgd import encode_reference

    return _run(
        "qsgd_encode",
        x.device.type,
        (x, residual, bits, levels, bucket_size, signed),
        lambda: encode_reference(x, bits, levels, bucket_size, seed, residual),
    )


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
    from ..codecs.qsgd import decode_reference

    _run(
        "qsgd_decode",
        out.device.type,
        (norms, packed, bits, levels, bucket_size, out, accumulate),
        lambda: decode_reference(norms, packed, bits, levels, bucket_size, out, accumulate),
    )


# ----- top-k --------------------------------------------------------------------------------------
def topk_select(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, values)`` of the k largest ``|x|``, exact, indices ascending; see the reference."""
    _check_vector("x", x)
    from ..codecs.topk import select_reference

    return _run("topk_select", x.device.type, (x, k), lambda: select_reference(x, k))


def sparse_scatter_add(
    indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor], out: torch.Tensor
) -> None:
    """``out[indices[p]] += values[p]`` for every payload p, in order (bounds/duplicate-checked)."""
    _check_vector("out", out)
    indices, values = list(indices), list(values)
    from ..codecs.topk import scatter_add_reference

    _run(
        "sparse_scatter_add",
        out.device.type,
        (indices, values, out),
        lambda: scatter_add_reference(indices, values, out),
    )


# ----- random-k -----------------------------------------------------------------------------------
def randomk_gather(x: torch.Tensor, k: int, seed: int, scaled: bool) -> torch.Tensor:
    """The k values random-k sends for 1-D ``x``; see :func:`commpress.codecs.randomk.gather_reference`."""
    _check_vector("x", x)
    signed = _signed_seed(seed)
    from ..codecs.randomk import gather_reference

    return _run(
        "randomk_gather",
        x.device.type,
        (x, k, signed, scaled),
        lambda: gather_reference(x, k, seed, scaled),
    )


def randomk_scatter_add(values: torch.Tensor, seed: int, out: torch.Tensor) -> None:
    """``out[idx] += values`` at the seed's random-k indices (1-D contiguous ``out``)."""
    _check_vector("out", out)
    signed = _signed_seed(seed)
    from ..codecs.randomk import scatter_add_reference

    values = values.contiguous()
    _run(
        "randomk_scatter_add",
        out.device.type,
        (values, signed, out),
        lambda: scatter_add_reference(values, seed, out),
    )
